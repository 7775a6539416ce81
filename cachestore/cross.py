"""Cross-attention K/V of an encoder-decoder model in a store: one checked value per encoder input.

The value holds every decoder layer's cross K and V in the canonical layout
``[layers, 2 (k, v), heads, encoder_tokens, head_dim]`` (same codec and checks as prefix blocks,
kind CROSS_KV). A value larger than ``max_value_bytes`` is not stored at all (counted): it is
skipped by rule, never split and never half-written.
"""

from __future__ import annotations

import logging

import numpy as np

from cachestore.codec import (
    CodecError,
    Expected,
    RejectReason,
    ValueKind,
    check_range,
    decode,
    encode,
    encoded_bytes,
)
from cachestore.keys import BlockHash, cross_key
from cachestore.ratelimit import RateLimitedLog
from cachestore.stats import CacheStats
from cachestore.store import KVStore

log = logging.getLogger(__name__)
# One line per 10 s however many values a fault rejects; each is still counted in CacheStats.
_rejected = RateLimitedLog(log)


class CrossStore:
    def __init__(self, store: KVStore, stats: CacheStats, max_value_bytes: int, dtype: np.dtype) -> None:
        self.store = store
        self.dtype = dtype
        """The storage dtype: values are narrowed to it by ``put`` and must hold it for ``get``."""
        self.stats = stats
        self.max_value_bytes = max_value_bytes

    def get(self, input_hash: BlockHash, layers: int, heads: int, head_dim: int, max_tokens: int) -> np.ndarray | None:
        """The cached cross K/V of an encoder input in the storage dtype, or None (a bad value is
        counted and deleted). ``max_tokens``: the most encoder positions the input can give (its
        sequence axis: tokens, or audio frames that a strided encoder only shortens), so that a
        forged value cannot hold an impossible length, however well it is checksummed. Nor can it
        make the store read more than the longest value ``put`` could have stored for the input:
        its positions, as many as fit ``max_value_bytes``."""
        key = cross_key(input_hash)
        fit = self.max_value_bytes // (layers * 2 * heads * head_dim * self.dtype.itemsize)
        value = self.store.get(key, encoded_bytes((layers, 2, heads, min(max_tokens, fit), head_dim), self.dtype))
        if value is None:
            self.stats.add(cross_misses=1)
            return None
        try:
            kv = decode(value, Expected(ValueKind.CROSS_KV, input_hash, self.dtype, authenticated=self.store.authenticated))
            if kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != (layers, 2, heads, head_dim):
                raise CodecError(RejectReason.FORMAT, f"shape {kv.shape} does not fit {layers} layers x {heads} heads x {head_dim}")
            if not 1 <= kv.shape[3] <= max_tokens:
                raise CodecError(RejectReason.FORMAT, f"{kv.shape[3]} encoder positions; the input gives 1 to {max_tokens}")
        except CodecError as exc:
            self.stats.add(cross_misses=1)
            self.stats.count("rejected_values", exc.reason)
            _rejected.warning("cache value %s rejected (%s); deleted, running the encoder instead", key, exc)
            self.store.delete([key])
            return None
        self.stats.add(cross_hits=1, bytes_read=len(value))
        return kv

    def put(self, input_hash: BlockHash, kv: np.ndarray) -> bool:
        """Stores the cross K/V set-if-absent, unless its value would exceed ``max_value_bytes``
        (checked before anything is encoded, so a too-large value costs nothing) or hold what
        ``decode`` refuses (NaN, infinity, out of range), once narrowed to the storage dtype."""
        if kv.size * self.dtype.itemsize > self.max_value_bytes:
            self.stats.add(values_too_large=1)
            return False
        kv = kv.astype(self.dtype, copy=False)
        try:
            check_range(kv)  # what every reader would refuse is not stored
        except CodecError as exc:
            _rejected.warning("cross K/V of %s not stored (%s)", cross_key(input_hash), exc)
            return False
        value = encode(ValueKind.CROSS_KV, input_hash, kv)
        written = self.store.put(cross_key(input_hash), value)
        self.stats.add(bytes_sent=len(value))
        return written
