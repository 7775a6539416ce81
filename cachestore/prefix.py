"""Prefix blocks in a store: find the longest cached run of a prompt's blocks, and publish blocks.

Tensors here are in the canonical layout ``[layers, 2 (k, v), kv_heads, tokens, head_dim]``; the
engine converts to and from its model's own layout. Only full blocks are ever stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cachestore.codec import (
    CodecError,
    Expected,
    ValueKind,
    check_range,
    decode,
    encode,
)
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
    """Shape of one token's K/V in canonical layout, and the stored element type (the storage
    dtype, which may be narrower than the model's: ``cachestore.storage_dtype``)."""

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
    """Canonical K/V of the run's blocks that the lookup's ``into`` kept (all of them without
    one): read-only views of the fetched values, no copy. Emptied by ``release``."""
    hit_blocks: int = 0
    """Length of the run found (kept after ``release``)."""

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

    def lookup(self, namespace: Namespace, token_ids: Sequence[int],
               into: Callable[[int, np.ndarray], bool] | None = None) -> PrefixLookup:
        """One batched read of every full block's key, each value checked as it arrives; the run
        stops at the first miss, and a value that fails a check is counted, deleted, and ends the
        run like a miss. With ``into``, block ``i`` of the run goes to ``into(i, block)`` as soon as
        it is checked, before the next value is read, and is kept only if ``into`` returns True:
        a fetch that copies each block into its slot holds one value at a time."""
        found = PrefixLookup(hashes=self.hashes(namespace, token_ids), blocks=[])
        hits = self.extend(found, namespace.block_size, into)
        self.stats.add(block_hits=hits, block_misses=len(found.hashes) - hits)
        return found

    def extend(self, found: PrefixLookup, block_size: int, into: Callable[[int, np.ndarray], bool] | None = None,
               limit: int | None = None) -> int:
        """Reads on from the end of ``found``'s run (blocks another worker published since), at
        most ``limit`` blocks, as ``lookup`` reads; adds them to ``found`` and returns how many
        were added. Not counted as hits or misses: ``lookup`` counted the prompt's blocks once."""
        first = found.hit_blocks
        hashes = found.hashes[first : None if limit is None else first + limit]
        keys = [block_key(h) for h in hashes]
        expected = Expected(ValueKind.PREFIX_BLOCK, b"", self.geometry.dtype, self.geometry.block_shape(block_size),
                            self.store.authenticated)
        hits, rejected = 0, []
        values = self.store.iter_many(keys)
        try:
            for h, key, value in zip(hashes, keys, values, strict=False):
                if value is None:
                    break
                try:
                    block = decode(value, replace(expected, owner=h))
                except CodecError as exc:
                    self.stats.count("rejected_values", exc.reason)
                    _rejected.warning("cache value %s rejected (%s); deleted, computing instead", key, exc)
                    rejected.append(key)
                    break
                self.stats.add(bytes_read=len(value))
                if into is None or into(first + hits, block):
                    found.blocks.append(block)
                hits += 1
        finally:
            values.close()  # hands the stream's connection back before the delete needs one
        if rejected:
            self.store.delete(rejected)
        found.hit_blocks += hits
        return hits

    def publish(self, hashes: Sequence[BlockHash], kv: np.ndarray, first_block: int, block_size: int) -> int:
        """Writes blocks ``first_block .. len(hashes)`` under their hashes, set-if-absent; ``kv``
        (canonical, any float dtype) holds exactly those blocks' tokens, from block ``first_block``
        on, and is narrowed to the storage dtype here. A block that would not pass a reader's range
        check once narrowed ends the publish there: later blocks are only reachable through it.
        Returns how many were new.

        Block ``first_block`` is written last, in a write of its own, once every later block is
        stored: a lookup, which stops at its first miss, finds none of this publish's blocks or
        all of them, never part. A worker arriving mid-publish so stops at ``first_block``, whose
        lease the publisher holds (``services.engine.leases``), not at a block inside the run that
        nobody holds: it would take that block's lease and compute the rest again. One write of
        all the blocks would not do: a Redis pipeline interleaves with other clients' reads once
        its values span several socket reads, and a cluster writes to each node apart."""
        size = block_size
        assert kv.shape[3] == (len(hashes) - first_block) * size, "kv must hold exactly the blocks to publish"
        items = []
        for i in range(first_block, len(hashes)):
            j = i - first_block
            block = kv[:, :, :, j * size : (j + 1) * size, :].astype(self.geometry.dtype, copy=False)
            try:
                check_range(block)
            except CodecError as exc:
                _rejected.warning("block %s and later ones not stored (%s)", block_key(hashes[i]), exc)
                break
            items.append((block_key(hashes[i]), encode(ValueKind.PREFIX_BLOCK, hashes[i], block)))
        gate, run = items[:1], items[1:]
        written = (self.store.put_many(run) if run else 0) + self.store.put_many(gate)
        self.stats.add(blocks_written=written, bytes_sent=sum(len(v) for _, v in items))
        return written
