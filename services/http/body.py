"""A JSON request body read field by field: each getter checks one field's type and range and
refuses with a 400 naming it, as OpenAI's API does. A JSON ``null`` reads as absent. Fields
nobody reads are ignored (OpenAI's clients send fields this server has no use for), except those
in ``REFUSED``, whose silent loss would change the answer."""

from __future__ import annotations

import json
import math
from typing import Any

from services.http.errors import ApiError, bad_request

REFUSED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "structured output (JSON mode, JSON schema) is not supported",
    "logit_bias": "logit_bias is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported",
    "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported",
}
"""Fields refused whenever set (not null): ignoring them would return something else than asked."""

TOKEN_ID_MAX = 2**31 - 1
"""The largest token id the gRPC request holds (its token id fields are int32): a larger one is no
vocabulary's, and must be refused here, before protobuf refuses it with an exception."""
UINT32_MAX = 2**32 - 1
"""The largest value of the gRPC request's unsigned counts (``top_k``)."""


class Body:
    """A request's JSON object. ``refuse_unsupported`` first, then the getters."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise bad_request(None, f"the request body must be a JSON object, got {_kind(data)}")
        self.data = data

    @classmethod
    def parse(cls, raw: bytes) -> Body:
        try:
            return cls(json.loads(raw))
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise bad_request(None, f"the request body is not valid JSON ({exc})") from None
        except RecursionError:
            raise bad_request(None, "the request body nests too deeply") from None

    def refuse_unsupported(self) -> None:
        for name, why in REFUSED.items():
            if self.data.get(name) not in (None, [], {}):
                raise bad_request(name, why)

    def present(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_request(name, f"must be a string, got {_kind(value)}")
        return text(name, value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(name, f"must be true or false, got {_kind(value)}")
        return value

    def integer(self, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
        """An integer (a float with no fraction, e.g. 16.0, counts), within [lo, hi] when given."""
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(name, f"must be an integer, got {_kind(value)}")
        _check_range(name, value, lo, hi)
        return value

    def number(self, name: str, lo: float | None = None, hi: float | None = None) -> float | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(_as_float(value)):
            raise bad_request(name, f"must be a finite number, got {_kind(value)}")
        _check_range(name, value, lo, hi)
        return float(value)

    def strings(self, name: str) -> list[str]:
        """A string or a list of strings (``stop``), as a list; absent: []."""
        value = self.data.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [text(name, value)]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [text(f"{name}[{i}]", v) for i, v in enumerate(value)]
        raise bad_request(name, f"must be a string or a list of strings, got {_kind(value)}")

    def token_ids(self, name: str) -> list[int]:
        """A list of token ids; absent: []."""
        value = self.data.get(name)
        if value is None:
            return []
        if is_integers(value):
            return checked_ids(name, value)
        raise bad_request(name, f"must be a list of integers, got {_kind(value)}")

    def object(self, name: str) -> Body | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise bad_request(name, f"must be an object, got {_kind(value)}")
        return Body(value)


def is_integers(value: Any) -> bool:
    """Whether ``value`` is a JSON array of integers (true and false are not)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def checked_ids(name: str, ids: list[int]) -> list[int]:
    """``ids``, each within the gRPC request's int32; the worker checks them against its vocabulary."""
    for i, token_id in enumerate(ids):
        if not -TOKEN_ID_MAX - 1 <= token_id <= TOKEN_ID_MAX:
            raise bad_request(f"{name}[{i}]", f"token id {token_id} is outside the vocabulary")
    return ids


def text(name: str, value: str) -> str:
    """``value`` when it is Unicode text. JSON can spell an unpaired UTF-16 surrogate (``"\\ud800"``),
    which Python's ``json`` keeps and no UTF-8 string (a protobuf ``string``) can hold."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise bad_request(name, f"holds an unpaired UTF-16 surrogate (\\u{ord(value[exc.start]):04x}) at character "
                          f"{exc.start}: not Unicode text") from None
    return value


def _as_float(value: int | float) -> float:
    """``value`` as a float; an integer beyond every float (Python reads JSON integers of up to 4300
    digits) is infinite."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"between {lo} and {hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise bad_request(name, f"must be {span}, got {_number(value)}")


def _number(value: int | float) -> str:
    """A number as messages show it: an integer of more than 20 digits (Python's json reads 4300) by its first
    digits and its length."""
    shown = str(value)
    digits = len(shown.lstrip("-"))
    return shown if isinstance(value, float) or digits <= 20 else f"{shown[:8]}... ({digits} digits)"


def _kind(value: Any) -> str:
    """How a JSON value is named in messages: its JSON type, never its (possibly huge) content."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        finite = isinstance(value, int) or math.isfinite(value)
        return f"the number {_number(value)}" if finite else "a non-finite number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def too_large(limit: int, what: str = "the server's --max-message-bytes") -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes ({what})", code="request_too_large")
