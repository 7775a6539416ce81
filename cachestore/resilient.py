"""Wraps a store so that it can never fail a request: errors become misses and dropped writes.

Every failure is counted; one log line is written per burst of failures (the first one, and a
line when the store answers again); a circuit breaker stops calling a store that keeps failing and
probes it again after a backoff.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from cachestore.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from cachestore.stats import CacheStats
from cachestore.store import KVStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class ResilientStore(KVStore):
    def __init__(self, inner: KVStore, stats: CacheStats, policy: BreakerPolicy = BreakerPolicy()) -> None:
        self.inner = inner
        self.stats = stats
        self.breaker = CircuitBreaker(policy)
        self.name = inner.name
        self._in_burst = False

    def _call(self, operation: str, fn: Callable[[], T], fallback: T) -> T:
        if not self.breaker.allow():
            self.stats.add(short_circuited=1)
            return fallback
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the store is an optimisation; any failure is a miss
            self.stats.add(store_errors=1)
            self.breaker.failure()
            if not self._in_burst:
                self._in_burst = True
                log.warning("cache store %s failing (%s: %s: %s); computing instead, breaker %s",
                            self.name, operation, type(exc).__name__, exc, self.breaker.state.value)
            return fallback
        if self._in_burst:
            self._in_burst = False
            log.warning("cache store %s answers again", self.name)
        self.breaker.success()
        return result

    @property
    def state(self) -> BreakerState:
        return self.breaker.state

    def get(self, key: str) -> bytes | None:
        return self._call("get", lambda: self.inner.get(key), None)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get_many", lambda: self.inner.get_many(keys), [None] * len(keys))

    def put(self, key: str, value: bytes) -> bool:
        return self._call("put", lambda: self.inner.put(key, value), False)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        return self._call("put_many", lambda: self.inner.put_many(items), 0)

    def delete(self, keys: Sequence[str]) -> None:
        self._call("delete", lambda: self.inner.delete(keys), None)

    def ping(self) -> None:
        self.inner.ping()

    def close(self) -> None:
        self.inner.close()
