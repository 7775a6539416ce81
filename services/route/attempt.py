"""One try of a call at one worker, watched so that a frozen worker cannot hold it.

Three things end a try early (each raises ``Cut``, whose ``why`` names the worker):

- the first response message (a stream's first tokens, a unary call's answer) takes longer than
  ``Limits.first_response_s``: the worker's queue wait and prefill, so a generous bound;
- a stream that has begun goes ``Limits.stream_idle_s`` without a message. Only the time spent
  waiting for the worker counts: while the router waits for its caller to take a message (a slow
  reader), the worker is held back by flow control and its silence is not its own;
- a health check of the worker failed (no answer, not an answer of NOT_SERVING) and the try had
  heard nothing from it since that check was sent (``cut_if_silent_since``): a worker that is
  still streaming to this try is alive whatever its health service said.

Everything runs on the router's event loop; times are that loop's clock, in seconds.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Limits:
    """``RouteSettings.first_response_timeout_s`` and ``stream_idle_timeout_s``; 0 = no bound."""

    first_response_s: float
    stream_idle_s: float


class Cut(Exception):
    """The router ended a try; ``why`` (for the caller's status and the log) names the worker."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Attempt:
    """A try at ``address``. ``received``: response messages the worker has sent so far;
    ``heard_at``: when the last arrived (-inf before the first)."""

    def __init__(self, address: str, limits: Limits) -> None:
        self.address = address
        self.received = 0
        self.heard_at = -math.inf
        self._limits = limits
        self._cut: str | None = None
        self._waiting: asyncio.Timeout | None = None
        """Set while awaiting the worker: the bound that a cut reschedules to now."""

    async def receive(self, response: Callable[[], Awaitable[T]]) -> T:
        """Awaits ``response()`` (the worker's next message, or ``grpc.aio.EOF`` at the end of a
        stream) under the bound that applies; raises Cut past it, or at once if the try was cut.
        Cancelling the await cancels the worker's call (gRPC does, on the way out)."""
        if self._cut is not None:
            raise Cut(self._cut)
        limit = self._limits.stream_idle_s if self.received else self._limits.first_response_s
        loop = asyncio.get_running_loop()
        bound = asyncio.timeout_at(loop.time() + limit if limit else None)
        try:
            async with bound:
                self._waiting = bound
                message = await response()
        except TimeoutError:
            if not bound.expired():
                raise
            raise Cut(self._cut or self._silence(limit)) from None
        finally:
            self._waiting = None
        if message is not grpc.aio.EOF:
            self.received += 1
            self.heard_at = loop.time()
        return message

    def cut_if_silent_since(self, since: float, why: str) -> bool:
        """Cuts the try (its wait for the worker ends now, or its next one at once) unless a
        message arrived at or after ``since``; returns whether it did."""
        if self.heard_at >= since or self._cut is not None:
            return False
        self._cut = f"worker {self.address} failed a health check ({why})"
        if self._waiting is not None:
            self._waiting.reschedule(-math.inf)  # fires on the loop's next turn
        return True

    def _silence(self, limit: float) -> str:
        if self.received:
            return f"worker {self.address} sent nothing for {limit:g} s (--stream-idle-timeout-s)"
        return f"worker {self.address} sent no response within {limit:g} s (--first-response-timeout-s)"
