"""In-process LRU store bounded in bytes: the embedded default and the L1 of the tiered store."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from cachestore.store import KVStore


class MemoryStore(KVStore):
    """Least-recently-used eviction once the values' total size passes ``max_bytes``.

    A value larger than ``max_bytes`` is not stored, and one longer than a read's ``limit`` reads
    as a miss, as from any store (it is this process's own memory: nothing to distrust). Thread-safe.
    """

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is None or (limit is not None and len(value) > limit):
                return None
            self._values.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            return False
        with self._lock:
            if key in self._values:
                return False
            self._values[key] = value
            self._bytes += len(value)
            while self._bytes > self.max_bytes:
                _, evicted = self._values.popitem(last=False)
                self._bytes -= len(evicted)
            return True

    def delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                value = self._values.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)
