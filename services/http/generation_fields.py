"""The request fields that chat and text completions share, read into a ``pb.GenerateRequest``:
sampling, stops, counts and kvshare's extras (accepted as extra body fields, as vLLM accepts
them: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``cache_salt``, ``stop_token_ids``, ``include_stop_str_in_output``).

Ranges that only the worker knows (its cap on tokens, its batch size for ``n``) are checked by the
worker, whose refusal names the HTTP field (``errors.http_name``)."""

from __future__ import annotations

from kvshare.v1 import generator_pb2 as pb
from services.http.body import UINT32_MAX, Body
from services.http.errors import bad_request

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default when a request sets none (vLLM's too, for folders without sampling defaults)."""

MAX_N = 128
"""Samples per request this face forwards; the worker refuses more than its batch holds."""


def generation_request(body: Body, request_id: str, max_tokens_default: int) -> pb.GenerateRequest:
    """Every shared field of ``body``. ``max_tokens_default``: the count when the request sets
    none (0: as many as fit, as for chat; 16 for text completions, as OpenAI's legacy API)."""
    sampling = pb.SamplingParams(temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0))
    top_p = body.number("top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0.0:
            raise bad_request("top_p", "must be above 0 (use temperature 0 for greedy decoding)")
        sampling.top_p = top_p
    seed = body.integer("seed")
    if seed is not None:
        sampling.seed = seed % 2**64  # OpenAI takes any integer; the worker a uint64
    sampling.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    sampling.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    top_k = body.integer("top_k", -1, UINT32_MAX)
    sampling.top_k = 0 if top_k in (None, -1) else top_k  # vLLM's -1 and kvshare's 0 both mean off
    sampling.min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    repetition = body.number("repetition_penalty", 0.01, 100.0)
    if repetition is not None:
        sampling.repetition_penalty = repetition
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        max_new_tokens=_max_tokens(body, max_tokens_default),
        min_new_tokens=body.integer("min_tokens", 0, 2**31 - 1) or 0,
        stop=body.strings("stop"),
        stop_token_ids=body.token_ids("stop_token_ids"),
        include_stop_str_in_output=body.boolean("include_stop_str_in_output"),
        ignore_eos=body.boolean("ignore_eos"),
        n=body.integer("n", 1, MAX_N) or 1,
        cache=pb.CacheOptions(salt=body.string("cache_salt", "")),
    )
    best_of = body.integer("best_of", 1)
    if best_of is not None and best_of != request.n:
        raise bad_request("best_of", "only best_of equal to n is supported (every sample is returned)")
    return request


def _max_tokens(body: Body, default: int) -> int:
    """``max_completion_tokens`` (OpenAI's current name) over ``max_tokens``."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.integer(name, 0, 2**31 - 1)
        if value == 0:
            raise bad_request(name, "must be at least 1 (leave it out for as many tokens as fit)")
        if value is not None:
            return value
    return default


def _number(body: Body, name: str, default: float, lo: float, hi: float) -> float:
    value = body.number(name, lo, hi)
    return default if value is None else value
