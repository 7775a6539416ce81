"""How request bodies come in: read a piece at a time, each body bounded as it arrives (chunked or
compressed included: what is counted is what aiohttp hands over, decoded), and all bodies in flight
together bounded by one budget, so that no framing makes the server buffer what it will refuse.

aiohttp decodes ``Content-Encoding`` gzip and deflate (br and zstd where their libraries are
installed) as it reads: 64 KiB of output per step, and none while the connection's read-ahead is
full (2 x 64 KiB), so a compressed body's decoded bytes wait in at most that much until read here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import hdrs, web

from services.http.body import too_large
from services.http.errors import RETRY_AFTER_S, ApiError, bad_request
from services.http.server_log import one_line
from services.runtime.memory import return_free_memory

ENCODINGS = frozenset({"identity", "gzip", "deflate", "br", "zstd"})
"""``Content-Encoding`` values aiohttp decodes (br and zstd only with their libraries: without them
aiohttp refuses the request itself, 400, before any handler runs); any other is refused here rather
than read as if it were not encoded."""
_SHOWN = 64
"""Characters of a client's header value repeated in a refusal."""
TRIM_BYTES = 64 * 1024 * 1024
"""Once bodies of this many bytes in all have been given back, the allocator's free pages are
handed back to the system (on a thread): glibc keeps what bodies and their parsing freed (a big
body is parsed on a thread, in that thread's arena); three rounds of 40 slow 4 MiB bodies left a
worker 90 MiB larger without it, 50 MiB with it."""


class BodyBudget:
    """Bytes of request bodies held by the requests in flight, all together: ``held`` never exceeds
    ``limit``; a request that would pass it gets 503 with ``Retry-After``. ``peak`` is the most
    ever held at once. Each request holds a ``Share`` until it is answered (what its body became,
    its prompt, lives that long), given back whole however it ends (answered, refused, cancelled by
    a client that left)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._untrimmed = 0

    @contextmanager
    def share(self) -> Iterator[Share]:
        share = Share(self)
        try:
            yield share
        finally:
            self.held -= share.taken
            self._untrimmed += share.taken
            if self._untrimmed >= TRIM_BYTES:
                self._untrimmed = 0
                asyncio.get_running_loop().run_in_executor(None, return_free_memory)


class Share:
    """One request's part of a ``BodyBudget`` (bytes)."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.taken = 0

    def take(self, count: int) -> None:
        budget = self._budget
        if budget.held + count > budget.limit:
            raise ApiError(503, f"the server is holding its limit of {budget.limit} bytes of request bodies "
                           f"(--http-max-buffered-bytes): retry in {RETRY_AFTER_S} s", "service_unavailable",
                           code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        budget.held += count
        self.taken += count
        budget.peak = max(budget.peak, budget.held)


def encoding(request: web.Request) -> str:
    """The body's ``Content-Encoding`` (lower case; ``identity`` when none); 400 for one aiohttp
    does not decode."""
    value = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower() or "identity"
    if value not in ENCODINGS:
        raise bad_request(None, f"Content-Encoding {value[:_SHOWN]!r} is not supported: send the body as is, or "
                          "compressed with gzip or deflate (one encoding)")
    return value


def may_grow(request: web.Request) -> bool:
    """Whether the body may be larger than its ``Content-Length`` says, or than a small one:
    chunked (no length), or compressed (the length is what is sent, not what it decodes to)."""
    return request.content_length is None or encoding(request) != "identity"


def expected_bytes(request: web.Request, limit: int) -> int:
    """The most a body read whole may hold: its ``Content-Length``, or ``limit`` where it may grow."""
    return limit if may_grow(request) else min(request.content_length, limit)


async def read_body(request: web.Request, limit: int, what: str, share: Share) -> bytes:
    """The whole (decoded) body, read a piece at a time into ``share``: 413 as soon as it would
    pass ``limit`` (``what`` names that bound), so at most ``limit`` bytes are ever held for it.
    Its ``Content-Encoding`` was checked (``may_grow``)."""
    pieces, count = [], 0
    while piece := await request.content.readany():
        if count + len(piece) > limit:
            raise too_large(limit, what)
        share.take(len(piece))
        count += len(piece)
        pieces.append(piece)
    return b"".join(pieces)


def undecodable(request: web.Request, exc: Exception) -> ApiError:
    """The 400 for a body aiohttp could not read: one that does not decode as its
    ``Content-Encoding`` says, or whose chunked framing breaks off."""
    detail = one_line(exc)
    name = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()[:_SHOWN]
    if name not in ("", "identity"):
        return bad_request(None, f"the request body does not decode as its Content-Encoding {name!r} says "
                           f"({detail}): send valid {name} data, or the body uncompressed without that header")
    return bad_request(None, f"the request body could not be read ({detail})")
