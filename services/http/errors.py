"""OpenAI's error object, and the one mapping from gRPC statuses to HTTP ones.

Every refusal leaves as ``{"error": {"message", "type", "param", "code"}}`` with the status the
OpenAI clients turn into their own exceptions (400 ``BadRequestError``, 401
``AuthenticationError``, 429 ``RateLimitError``...). A worker's message names its gRPC fields
(``max_new_tokens``, ``sampling.temperature``); here they are renamed to the HTTP API's
(``max_tokens``, ``temperature``), so the message names what the caller sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import grpc

RETRY_AFTER_S = 1
"""Retry-After on a 429: a full worker frees slots as streams end, typically within seconds."""

_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
"""Anything else (INTERNAL, UNKNOWN, DATA_LOSS) is the server's fault: 500."""
_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}
"""OpenAI's codes for these statuses; a 400's code is null, as OpenAI's mostly are."""

_GRPC_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "cache.salt": "cache_salt",
    "prompt_token_ids": "prompt",
    "encoder_audio": "file",
    "sampling.": "",
    "the metadata 'authorization: Bearer KEY'": "the header 'Authorization: Bearer KEY'",
}
_RENAME = re.compile(r"\b(?:max_new_tokens|min_new_tokens|cache\.salt|prompt_token_ids|encoder_audio|sampling\.)"
                     r"|the metadata 'authorization: Bearer KEY'")


def http_name(text: str) -> str:
    """``text`` with the gRPC request's field names replaced by the HTTP API's."""
    return _RENAME.sub(lambda m: _GRPC_NAMES[m.group(0)], text)


@dataclass
class ApiError(Exception):
    """A refusal, as OpenAI's error object. ``param`` names the request field at fault."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


_TOO_LARGE = re.compile(r"(?:Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")
"""gRPC's own refusal of a message over a receive or send bound, before it is read: no retry helps."""


def from_rpc(err: grpc.aio.AioRpcError) -> ApiError:
    """The HTTP face of a failed gRPC call. A worker's INVALID_ARGUMENT reads ``field: why``:
    the field becomes ``param``; a message over the worker's receive bound is a 413."""
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (large := _TOO_LARGE.search(err.details() or "")):
        return ApiError(413, f"the request is {large[1]} bytes as a gRPC message; the worker reads at most "
                        f"{large[2]} (the largest valid request of its model, or --max-message-bytes if smaller): "
                        "shorten the prompt, or raise the worker's --max-prompt-bytes", code="request_too_large")
    status, kind = _STATUS.get(err.code(), (500, "server_error"))
    message = http_name(err.details() or err.code().name)
    param = None
    if status == 400:
        head, sep, _ = message.partition(": ")
        param = head if sep and " " not in head else None
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else {}
    return ApiError(status, message, kind, param, _CODES.get(status, None if status == 400 else err.code().name.lower()),
                    headers)
