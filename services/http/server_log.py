"""aiohttp's server log, tamed: what a client did wrong is not the server's crash.

aiohttp logs a request it cannot parse (a bad request line, header or chunk size; a body that does
not decode) with ``logger.exception``: a traceback per request, which an operator reads as a crash
and a client can send a thousand times a second. Here such a record is one WARNING line, at most
one per ``RateLimitedLog`` interval (the next says how many were held back), and a client that
left mid-request is one DEBUG line. Anything else (the server's own fault) keeps its traceback.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from cachestore.ratelimit import RateLimitedLog

CLIENT_FAULTS = (HttpProcessingError, RequestPayloadError)
"""Exceptions aiohttp raises for what a client sent: its 400s."""
CLIENT_GONE = (ConnectionError, asyncio.CancelledError)
_SHOWN = 200
"""Characters of a refused request's description logged (it quotes the client's bytes)."""


def one_line(exc: BaseException) -> str:
    """``exc`` as one line of printable ASCII: aiohttp's messages span lines and quote the
    client's bytes, which must not forge log lines; its status prefix ("400, message:") goes."""
    text = " ".join(str(exc).split()).removeprefix("400, message: ")[:_SHOWN]
    return text.encode("ascii", "backslashreplace").decode()


class ServerLog(logging.LoggerAdapter):
    """The ``logger`` aiohttp's request handlers write to (``aiohttp.server``)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._refused = RateLimitedLog(self.logger)

    def exception(self, msg: object, *args: object, exc_info: object = True, **kwargs) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        said = str(msg) % args if args else str(msg)  # aiohttp's words: "Error handling request from ADDRESS"
        if isinstance(exc, CLIENT_FAULTS):
            self._refused.warning("refused a malformed HTTP request: %s [aiohttp: %s]", one_line(exc), said)
        elif isinstance(exc, CLIENT_GONE):
            self.logger.debug("an HTTP client left mid-request: %r [aiohttp: %s]", exc, said)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)
