"""Counters of the cache tier, shared by the store wrapper and the prefix cache above it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters since start. ``add`` is thread-safe."""

    block_hits: int = 0
    block_misses: int = 0
    corrupt_values: int = 0
    cross_hits: int = 0
    cross_misses: int = 0
    values_too_large: int = 0
    store_errors: int = 0
    short_circuited: int = 0
    blocks_written: int = 0
    publishes_dropped: int = 0
    bytes_read: int = 0
    bytes_sent: int = 0
    """Bytes of values sent to the store, including blocks it turned out to hold already."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
