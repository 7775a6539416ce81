"""How an admitted call's single request message is read: within ``read_timeout_s``; for a call
the door gave no place of its own, under a receiving place (``receiving``), so that the messages
still arriving are bounded together; and not at all once the worker drains.

gRPC reads a message whole before a handler sees it, and, asked for the next message, lets the
client send as much as the message's length prefix says (up to the server's receive bound): a
call whose message never ends holds what it sent until the call ends. The receive bound, the
places and the read timeout bound that; a draining worker ends such calls at once (they hold no
work, and would otherwise hold its shutdown for the whole drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message

from services.engine.door import Ticket, Tickets
from services.errors import Overloaded

DRAINING = ("the worker is shutting down and its request message had not arrived: send the request to another "
            "replica")


@dataclass(frozen=True, slots=True)
class Unparseable:
    """A request whose bytes are not a valid message of ``type_name``; ``error`` says why."""

    type_name: str
    error: str

    @property
    def details(self) -> str:
        return f"request is not a valid {self.type_name}: {self.error}"


@dataclass(frozen=True, slots=True)
class Oversized:
    """A request larger than any valid one of its method can be (``details`` says why), refused
    unparsed: parsing four million ids holds the event loop and costs tens of MB."""

    details: str


MIN_RECEIVING_PLACES = 4
"""With fewer, two clients could hold every place at their half each, and none could be taken back
(a place is taken from a client holding more than the newcomer would with one more)."""


def receiving_places(budget_bytes: int, message_bytes: int) -> int:
    """Calls whose message may be arriving at once: as many of the largest message as the budget
    holds, at least ``MIN_RECEIVING_PLACES``."""
    return max(MIN_RECEIVING_PLACES, budget_bytes // message_bytes)


def receiving_tickets(budget_bytes: int, message_bytes: int) -> Tickets:
    """The places of calls whose request message is arriving (those the door gave no place):
    each may hold up to ``message_bytes`` (the server's receive bound) until it has come, so
    ``budget_bytes`` bounds what such calls hold together, and one client holds at most half."""
    return Tickets(receiving_places(budget_bytes, message_bytes), "calls whose request message is still arriving",
                   f"--max-receiving-bytes {budget_bytes} over messages of up to {message_bytes} bytes:")


@dataclass(slots=True)
class MessageIntake:
    read_timeout_s: float = 0.0
    """0: no bound."""
    receiving: Tickets | None = None
    """None: no bound on messages arriving at once."""
    draining: bool = False
    _reads: set[asyncio.Future] = field(default_factory=set, repr=False)

    def drain(self) -> int:
        """Ends every call whose message has not come, and each admitted from now on, UNAVAILABLE
        (on the event loop). Returns how many were ended."""
        self.draining = True
        for read in self._reads:
            read.cancel()
        return len(self._reads)

    async def message(self, context: grpc.aio.ServicerContext, place: Ticket | None,
                      client: Callable[[grpc.aio.ServicerContext], str]) -> Message:
        """The call's message, held by the door's ``place``; a call the door gave none (a text
        model's Generate, a health check) takes a receiving place of ``client(context)`` until its
        message has come, RESOURCE_EXHAUSTED at once when none is free. A call with a place of the
        door needs no other: those places are as few as the calls whose messages may be arriving."""
        if place is not None or self.receiving is None:
            return await self._one(context, () if place is None else (place,))
        try:
            arriving = self.receiving.take(client(context))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        with arriving:
            return await self._one(context, (arriving,))

    async def _one(self, context: grpc.aio.ServicerContext, places: tuple[Ticket, ...]) -> Message:
        """The call's single request message, read within ``read_timeout_s``; a call without one,
        whose body does not arrive in time, one of whose ``places`` is taken back meanwhile (for
        another client: ``door.Tickets``), or whose worker drains, is aborted."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        read = asyncio.ensure_future(context.read())
        self._reads.add(read)
        loop = asyncio.get_running_loop()
        for place in places:
            place.waiting(lambda: loop.call_soon_threadsafe(read.cancel))
        try:
            async with asyncio.timeout(self.read_timeout_s or None):
                request = await read
        except TimeoutError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the request message did not arrive within {self.read_timeout_s:g} s of the call "
                                "(--request-read-timeout-s): the worker holds no place for a body that does not come")
        except asyncio.CancelledError:
            if any(place.revoked for place in places):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    "refused before its message arrived: every place for such calls was taken, and "
                                    "another client holding fewer took this one; send the message with the call, or "
                                    "retry later")
            if self.draining and read.cancelled():
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            raise
        finally:
            self._reads.discard(read)
            for place in places:
                place.waiting(None)
        if request is grpc.aio.EOF:
            try:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - gRPC's ExecuteBatchError: it ended the call itself
                # (a message that decompressed past the bound) and sent its own status; failing with
                # this error would log a traceback an operator reads as a crash.
                raise asyncio.CancelledError from exc
        if isinstance(request, Unparseable | Oversized):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return request
