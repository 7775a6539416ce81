"""A memory L1 in front of a shared L2: hot blocks are served from the worker's own memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cachestore.budget import StallBudget
from cachestore.memory import MemoryStore
from cachestore.store import KVStore, Notices


class TieredStore(KVStore):
    """Reads try L1 then L2 (filling L1 with what L2 had); writes go to both."""

    def __init__(self, l1: MemoryStore, l2: KVStore) -> None:
        self.l1, self.l2 = l1, l2
        self.name = f"tiered({l1.name}+{l2.name})"
        # The L1 holds only what L2 returned or this worker wrote itself.
        self.authenticated = l2.authenticated

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        return self.get_many([key], None if limit is None else [limit])[0]

    def get_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> list[bytes | None]:
        """Each tier applies the same ``limits``: the L2 (never reading a longer value whole), and the
        L1, which holds only values that passed them or that this worker wrote."""
        values = self.l1.get_many(keys, limits)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            l2_limits = None if limits is None else [limits[i] for i in missing]
            for i, value in zip(missing, self.l2.get_many([keys[i] for i in missing], l2_limits), strict=True):
                if value is not None:
                    self.l1.put(keys[i], value)
                    values[i] = value
        return values

    def put(self, key: str, value: bytes) -> bool:
        return self.put_many([(key, value)]) > 0

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        self.l1.put_many(items)
        return self.l2.put_many(items)

    def delete(self, keys: Sequence[str]) -> None:
        self.l1.delete(keys)
        self.l2.delete(keys)

    def claim(self, key: str, token: bytes, ttl_ms: int) -> bytes | None:
        return self.l2.claim(key, token, ttl_ms)

    def holder(self, key: str) -> bytes | None:
        return self.l2.holder(key)

    def release(self, key: str, token: bytes) -> None:
        self.l2.release(key, token)

    def renew(self, key: str, token: bytes, ttl_ms: int, replacement: bytes | None = None) -> bool:
        return self.l2.renew(key, token, ttl_ms, replacement)

    def stall_budget(self) -> StallBudget | None:
        return self.l2.stall_budget()

    def error_kind(self, exc: Exception) -> str:
        return self.l2.error_kind(exc)

    def announce(self, channels: Sequence[str]) -> None:
        self.l2.announce(channels)

    def notices(self, on_notice: Callable[[str, bool], None]) -> Notices | None:
        return self.l2.notices(on_notice)

    def ping(self, connections: int = 1) -> None:
        self.l2.ping(connections)

    def close(self) -> None:
        self.l2.close()
