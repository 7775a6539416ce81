"""Counters of the cache tier, shared by the store wrapper and the prefix cache above it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters since start; ``add`` and ``count`` are thread-safe. The two tables are
    counts by a bounded label (a ``RejectReason``, a store's error kind), so metrics can split them."""

    block_hits: int = 0
    block_misses: int = 0
    cross_hits: int = 0
    cross_misses: int = 0
    values_too_large: int = 0
    short_circuited: int = 0
    budget_skipped: int = 0
    """Store calls skipped because their request had already waited its budget on a store that
    did not answer (``cachestore.budget``): it computes instead."""
    blocks_written: int = 0
    publishes_dropped: int = 0
    blocks_awaited: int = 0
    """Blocks a lookup found missing while another worker held the lease on computing them."""
    blocks_received: int = 0
    """Of those, blocks that arrived while the lookup waited (the rest were computed here)."""
    fetches_skipped: int = 0
    """Prompt lookups not made because computing the cached run was expected faster."""
    window_misses: int = 0
    """Runs cut short because a block's windowed layers were missing or bad (models with windowed
    layers: ``PrefixStore.complete_windows``)."""
    bytes_read: int = 0
    bytes_sent: int = 0
    """Bytes of values sent to the store, including blocks it turned out to hold already."""
    rejected_values: dict[str, int] = field(default_factory=dict)
    """Stored values that failed a check (deleted, computed instead), by reason."""
    store_errors: dict[str, int] = field(default_factory=dict)
    """Store calls that failed (computed instead), by the store's error kind."""
    lease_waits: dict[str, int] = field(default_factory=dict)
    """Waits for another worker's blocks, by how they ended (``run_waits.WaitEnd``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def count(self, table: str, label: str, delta: int = 1) -> None:
        """Adds ``delta`` to ``label``'s count in the table ``table`` (a dict field)."""
        with self._lock:
            counts = getattr(self, table)
            counts[label] = counts.get(label, 0) + delta

    def snapshot(self) -> dict[str, int | dict[str, int]]:
        with self._lock:
            return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v)
                    for f in fields(self) if not f.name.startswith("_")}
