"""Wraps a store so that it can never fail a request: errors become misses and dropped writes.

Every failure is counted; one log line is written per burst of failures (the first one, and a
line when the store answers again), at most one of each per 10 s when failures and successes
alternate; a circuit breaker stops calling a store that keeps failing and
probes it again after a backoff. Reads and writes have a breaker each: a store that refuses writes
(full, with ``noeviction``) still serves the blocks it holds. A call made on a thread whose
request has waited its budget on the store (``cachestore.budget``) is skipped too, and counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from cachestore import budget
from cachestore.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from cachestore.ratelimit import RateLimitedLog
from cachestore.stats import CacheStats
from cachestore.store import KVStore, Notices

log = logging.getLogger(__name__)
T = TypeVar("T")


class ResilientStore(KVStore):
    def __init__(self, inner: KVStore, stats: CacheStats, policy: BreakerPolicy = BreakerPolicy()) -> None:
        self.inner = inner
        self.stats = stats
        self.read_breaker = CircuitBreaker(policy)
        self.write_breaker = CircuitBreaker(policy)
        self.name = inner.name
        self._failing: set[str] = set()
        self._lock = threading.Lock()
        # One limiter per (direction, state): a burst of write failures must not hide the reads'.
        self._logs = {(kind, state): RateLimitedLog(log) for kind in ("reads", "writes") for state in ("failing", "back")}
        self._announce_log = RateLimitedLog(log)

    def _allowed(self, breaker: CircuitBreaker) -> bool:
        """Whether a call goes to the store: not once this thread's request has waited its budget
        on it (checked first: the call would fail at once, and is no probe of the breaker's)."""
        if budget.spent():
            self.stats.add(budget_skipped=1)
            return False
        if not breaker.allow():
            self.stats.add(short_circuited=1)
            return False
        return True

    def _call(self, breaker: CircuitBreaker, operation: str, fn: Callable[[], T], fallback: T) -> T:
        if not self._allowed(breaker):
            return fallback
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the store is an optimisation; any failure is a miss
            self._failed(breaker, operation, exc)
            return fallback
        self._succeeded(breaker)
        return result

    def _failed(self, breaker: CircuitBreaker, operation: str, exc: Exception) -> None:
        kind = "reads" if breaker is self.read_breaker else "writes"
        self.stats.count("store_errors", self.inner.error_kind(exc))
        breaker.failure()
        with self._lock:
            first = kind not in self._failing
            self._failing.add(kind)
        if first:
            self._logs[kind, "failing"].warning("cache store %s failing %s (%s: %s: %s); computing instead, breaker %s",
                                                self.name, kind, operation, type(exc).__name__, exc, breaker.state.value)

    def _succeeded(self, breaker: CircuitBreaker) -> None:
        kind = "reads" if breaker is self.read_breaker else "writes"
        with self._lock:
            recovered = kind in self._failing
            self._failing.discard(kind)
        if recovered:
            self._logs[kind, "back"].warning("cache store %s answers %s again", self.name, kind)
        breaker.success()

    @property
    def state(self) -> BreakerState:
        """The read breaker's state: whether lookups currently reach the store."""
        return self.read_breaker.state

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        return self._call(self.read_breaker, "get", lambda: self.inner.get(key, limit), None)

    def get_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> list[bytes | None]:
        return self._call(self.read_breaker, "get_many", lambda: self.inner.get_many(keys, limits), [None] * len(keys))

    def iter_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> Iterator[bytes | None]:
        """The inner store's values as they arrive; a failure part-way ends the iteration (the
        rest are misses), counted like any failed read."""
        if not keys or not self._allowed(self.read_breaker):
            return
        try:
            yield from self.inner.iter_many(keys, limits)
        except GeneratorExit:  # the caller stopped early (a miss); the store answered
            self._succeeded(self.read_breaker)
            raise
        except Exception as exc:  # noqa: BLE001 - the store is an optimisation; any failure is a miss
            self._failed(self.read_breaker, "iter_many", exc)
            return
        self._succeeded(self.read_breaker)

    def put(self, key: str, value: bytes) -> bool:
        return self._call(self.write_breaker, "put", lambda: self.inner.put(key, value), False)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        return self._call(self.write_breaker, "put_many", lambda: self.inner.put_many(items), 0)

    def delete(self, keys: Sequence[str]) -> None:
        self._call(self.write_breaker, "delete", lambda: self.inner.delete(keys), None)

    def claim(self, key: str, token: bytes, ttl_ms: int) -> bytes | None:
        """A failed claim holds nothing: the caller computes, as it would without leases."""
        return self._call(self.write_breaker, "claim", lambda: self.inner.claim(key, token, ttl_ms), None)

    def holder(self, key: str) -> bytes | None:
        return self._call(self.read_breaker, "holder", lambda: self.inner.holder(key), None)

    def release(self, key: str, token: bytes) -> None:
        self._call(self.write_breaker, "release", lambda: self.inner.release(key, token), None)

    def renew(self, key: str, token: bytes, ttl_ms: int, replacement: bytes | None = None) -> bool:
        return self._call(self.write_breaker, "renew", lambda: self.inner.renew(key, token, ttl_ms, replacement), False)

    def announce(self, channels: Sequence[str]) -> None:
        """Best effort, outside the breakers: an announcement refused (an ACL without the channels)
        must not open the breaker that lets blocks be written. Skipped while writes are kept away."""
        if self.write_breaker.keeps_calls_away:
            return
        try:
            self.inner.announce(channels)
        except Exception as exc:  # noqa: BLE001 - waiters poll when announcements fail
            self._announce_log.warning("cache store %s: announcing failed (%s: %s); waiting workers poll instead",
                                       self.name, type(exc).__name__, exc)

    def notices(self, on_notice: Callable[[str, bool], None]) -> Notices | None:
        """The inner store's: a subscription absorbs its own failures (its listeners poll meanwhile)."""
        return self.inner.notices(on_notice)

    def error_kind(self, exc: Exception) -> str:
        return self.inner.error_kind(exc)

    def ping(self, connections: int = 1) -> None:
        self.inner.ping(connections)

    def close(self) -> None:
        self.inner.close()
