"""A circuit breaker, so that a dead store is not called on every request.

closed: calls go through; ``failure_threshold`` consecutive failures open it.
open: calls are refused for a backoff (doubling after each failed probe, capped).
half-open: once the backoff has passed, one probe call goes through; success closes the breaker,
failure opens it again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failure_threshold: int = 3
    backoff_ms: float = 1000.0
    max_backoff_ms: float = 30000.0


class CircuitBreaker:
    def __init__(self, policy: BreakerPolicy, clock=time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._backoff_ms = policy.backoff_ms
        self._open_until = 0.0
        self._probing = False
        self.state = BreakerState.CLOSED

    def allow(self) -> bool:
        """True if a call may go to the store now (in half-open state, only the one probe)."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN and self._clock() >= self._open_until:
                self.state = BreakerState.HALF_OPEN
                self._probing = False
            if self.state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    @property
    def keeps_calls_away(self) -> bool:
        """True while a call made now would be refused: open and still backing off, or half-open
        with its probe in flight. ``state`` alone says OPEN until the next call moves it on, so a
        breaker whose direction sees no traffic (every block already stored: no writes) would read
        as open long after its backoff ended."""
        with self._lock:
            if self.state is BreakerState.OPEN:
                return self._clock() < self._open_until
            return self.state is BreakerState.HALF_OPEN and self._probing

    def success(self) -> None:
        with self._lock:
            self.state = BreakerState.CLOSED
            self._failures = 0
            self._backoff_ms = self.policy.backoff_ms
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self.state is BreakerState.HALF_OPEN:
                self._backoff_ms = min(self._backoff_ms * 2, self.policy.max_backoff_ms)
            elif self._failures < self.policy.failure_threshold:
                return
            self.state = BreakerState.OPEN
            self._probing = False
            self._open_until = self._clock() + self._backoff_ms / 1e3
