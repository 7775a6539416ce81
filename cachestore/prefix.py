"""Prefix blocks in a store: find the longest cached run of a prompt's blocks, and publish blocks.

Tensors here are in the canonical layout ``[layers, 2 (k, v), kv_heads, tokens, head_dim]``; the
engine converts to and from its model's own layout. Only full blocks are ever stored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from cachestore.codec import CodecError, Expected, ValueKind, decode, encode
from cachestore.keys import BlockHash, Namespace, block_hashes, block_key
from cachestore.ratelimit import RateLimitedLog
from cachestore.stats import CacheStats
from cachestore.store import KVStore

log = logging.getLogger(__name__)
# One line per 10 s however many values a fault rejects; each is still counted in CacheStats.
_rejected = RateLimitedLog(log)
CANONICAL_LAYOUT = "layers,kv,kv_heads,tokens,head_dim"


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one token's K/V in canonical layout, and the stored element type."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype

    def block_shape(self, block_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, block_tokens, self.head_dim)


@dataclass(slots=True)
class PrefixLookup:
    """The cached run of a prompt's blocks, from block 0 up to the first missing or bad block."""

    hashes: list[BlockHash]
    """Chained hashes of every full block of the prompt."""
    blocks: list[np.ndarray]
    """Canonical K/V of each block of the run: read-only views of the fetched values, no copy.
    Emptied by ``release`` once they are copied into a slot."""
    hit_blocks: int = field(init=False)
    """Length of the run found (kept after ``release``)."""

    def __post_init__(self) -> None:
        self.hit_blocks = len(self.blocks)

    def release(self) -> None:
        """Drops the fetched values (they are in the slot now), keeping what was found."""
        self.blocks = []


class PrefixStore:
    def __init__(self, store: KVStore, geometry: KVGeometry, stats: CacheStats) -> None:
        self.store = store
        self.geometry = geometry
        self.stats = stats

    def hashes(self, namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
        return block_hashes(namespace, token_ids)

    def lookup(self, namespace: Namespace, token_ids: Sequence[int]) -> PrefixLookup:
        """One batched read of every full block's key; the run stops at the first miss, and a
        value that fails a check is counted, deleted, and ends the run like a miss."""
        hashes = self.hashes(namespace, token_ids)
        keys = [block_key(h) for h in hashes]
        values = self.store.get_many(keys) if keys else []
        expected = Expected(ValueKind.PREFIX_BLOCK, b"", self.geometry.dtype, self.geometry.block_shape(namespace.block_size),
                            self.store.authenticated)
        run: list[np.ndarray] = []
        for h, key, value in zip(hashes, keys, values, strict=True):
            if value is None:
                break
            try:
                run.append(decode(value, replace(expected, owner=h)))
            except CodecError as exc:
                self.stats.count("rejected_values", exc.reason)
                _rejected.warning("cache value %s rejected (%s); deleted, computing instead", key, exc)
                self.store.delete([key])
                break
            self.stats.add(bytes_read=len(value))
        self.stats.add(block_hits=len(run), block_misses=len(hashes) - len(run))
        return PrefixLookup(hashes=hashes, blocks=run)

    def publish(self, hashes: Sequence[BlockHash], kv: np.ndarray, first_block: int, block_size: int) -> int:
        """Writes blocks ``first_block .. len(hashes)`` under their hashes, set-if-absent; ``kv``
        (canonical) holds exactly those blocks' tokens, from block ``first_block`` on. Returns how
        many were new."""
        size = block_size
        assert kv.shape[3] == (len(hashes) - first_block) * size, "kv must hold exactly the blocks to publish"
        items = []
        for i in range(first_block, len(hashes)):
            j = i - first_block
            block = kv[:, :, :, j * size : (j + 1) * size, :].astype(self.geometry.dtype, copy=False)
            items.append((block_key(hashes[i]), encode(ValueKind.PREFIX_BLOCK, hashes[i], block)))
        written = self.store.put_many(items)
        self.stats.add(blocks_written=written, bytes_sent=sum(len(v) for _, v in items))
        return written
