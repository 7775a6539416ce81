"""The HTTP port's connections: how many may be open, and how long a request's head may take.

aiohttp has neither: its server takes every connection it is offered, and a client may trickle a
request's head a byte at a time for as long as it likes (its keep-alive timer only closes a
connection on which no request began). ``ConnectionGate`` is the listening socket's protocol
factory: each connection gets a ``_Gated`` protocol, which hands it on to aiohttp's handler while
fewer than ``limit`` are open. At the limit, a new connection takes the place of the connection
idle longest (open, no request begun: a silent client, or keep-alive between requests), which is
closed, as nginx reuses idle keep-alive connections; with none idle it is answered 503 and closed
at once (nothing waits in a queue). It also watches each connection between requests: from the first byte of a request to the
moment its head reaches the application (``serving``, from the face's middleware), at most
``header_timeout_s``; past that the connection is aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.http.errors import RETRY_AFTER_S, ApiError

log = logging.getLogger(__name__)


def _refusal(limit: int) -> bytes:
    error = ApiError(503, f"the server has its limit of {limit} HTTP connections open "
                     f"(--http-max-connections): retry in {RETRY_AFTER_S} s", "service_unavailable",
                     code="too_many_connections")
    body = json.dumps(error.body()).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Retry-After: %d\r\nContent-Length: %d\r\n\r\n%s" % (RETRY_AFTER_S, len(body), body))


class ConnectionGate:
    """At most ``limit`` connections open (``open``: counted from the moment aiohttp gets one,
    TLS handshake done, to its loss; ``refused``: connections answered ``refusal`` so far)."""

    def __init__(self, limit: int, header_timeout_s: float) -> None:
        self.limit = limit
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0
        self.evicted = 0
        self.refusal = _refusal(limit)
        self._idle: dict[int, _Gated] = {}
        """Connections with no request begun, longest idle first (dicts keep insertion order)."""

    def idle(self, protocol: _Gated, idle: bool) -> None:
        if idle:
            self._idle[id(protocol)] = protocol
        else:
            self._idle.pop(id(protocol), None)

    def make_room(self) -> bool:
        """Whether one more connection may open: under the limit, or after closing the connection
        idle longest."""
        if self.open < self.limit:
            return True
        if not self._idle:
            return False
        _, oldest = next(iter(self._idle.items()))
        oldest.evict()
        self.evicted += 1
        return True

    def factory(self, handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server``; ``handler`` makes aiohttp's protocol."""
        return lambda: _Gated(self, handler)

    @staticmethod
    @contextmanager
    def serving(transport: asyncio.BaseTransport | None) -> Iterator[None]:
        """While a request is in the application (its head arrived): no header deadline on its
        connection; the next request's first byte arms one."""
        protocol = transport.get_protocol() if transport is not None else None
        if not isinstance(protocol, _Gated):  # the connection is gone
            yield
            return
        protocol.in_request = True
        protocol.disarm()
        try:
            yield
        finally:
            protocol.in_request = False
            protocol.set_idle(True)


class _Gated(asyncio.Protocol):
    """One connection: aiohttp's protocol behind a count and a header deadline. States: between
    requests (``in_request`` false, no deadline), a head arriving (deadline armed by its first
    byte), a request in the application (``in_request``: its body has its own deadline)."""

    def __init__(self, gate: ConnectionGate, handler: Callable[[], asyncio.Protocol]) -> None:
        self._gate = gate
        self._handler = handler
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self._gate
        if not gate.make_room():
            gate.refused += 1
            transport.write(gate.refusal)
            transport.close()
            return
        gate.open += 1
        self._transport = transport
        self._inner = self._handler()
        self._inner.connection_made(transport)
        self.set_idle(True)

    def set_idle(self, idle: bool) -> None:
        if self._inner is not None:
            self._gate.idle(self, idle)

    def evict(self) -> None:
        """Closes this idle connection for a new one, counting it out now (its loss comes later)."""
        self.disarm()
        self._gate.idle(self, False)
        self._gate.open -= 1
        inner, self._inner = self._inner, None
        self._transport.abort()
        inner.connection_lost(None)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        self.set_idle(False)
        if not self.in_request and self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(self._gate.header_timeout_s, self._expire)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self._inner is not None:
            self._gate.idle(self, False)
            self._gate.open -= 1
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.in_request or self._transport is None:
            return
        log.debug("closed a connection whose request head took over %g s", self._gate.header_timeout_s)
        self._transport.abort()
