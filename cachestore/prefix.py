"""Prefix blocks in a store: find the longest cached run of a prompt's blocks, and publish blocks.

Tensors here are in the canonical layout ``[layers, 2 (k, v), kv_heads, tokens, head_dim]``; the
engine converts to and from its model's own layout. Only full blocks are ever stored.

Models with sliding-window layers (``KVGeometry.window``) keep each block as two values: the
layers that read every earlier position (under the block's key, ``ValueKind.PREFIX_BLOCK``) and the
windowed ones (``window_block_key``, ``ValueKind.WINDOW_BLOCK``); the canonical layer axis holds
the first group, then the second. A continuation after a cached run of N tokens reads the first
group for all N, the second only for the blocks that cover its last ``window - 1`` positions
(``complete_windows``): for Gemma 3 270M at a 4,096-token prefix about a quarter of the bytes.
Every publish writes both, since any block may end some later prompt's run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from cachestore.codec import (
    CodecError,
    Expected,
    ValueKind,
    check_range,
    decode,
    encode,
    encoded_bytes,
)
from cachestore.keys import (
    BlockHash,
    Namespace,
    block_hashes,
    block_key,
    window_block_key,
)
from cachestore.ratelimit import RateLimitedLog
from cachestore.stats import CacheStats
from cachestore.store import KVStore

log = logging.getLogger(__name__)
# One line per 10 s however many values a fault rejects; each is still counted in CacheStats.
_rejected = RateLimitedLog(log)
CANONICAL_LAYOUT = "layers,kv,kv_heads,tokens,head_dim"


Receiver = Callable[[int, np.ndarray, slice], bool]
"""Takes block ``i``'s checked value and the canonical layers it holds (``KVGeometry.full`` or
``windowed``) as it arrives; True keeps the value in the lookup, False drops it (copied already)."""


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one token's K/V in canonical layout, and the stored element type (the storage
    dtype, which may be narrower than the model's: ``cachestore.storage_dtype``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype
    window: int = 0
    """Positions a windowed layer's query sees, its own included; 0: no windowed layers."""
    window_layers: int = 0
    """How many layers are windowed: the last ones of the canonical layer axis."""

    def __post_init__(self) -> None:
        if (self.window > 0) != (self.window_layers > 0) or not 0 <= self.window_layers <= self.num_layers:
            raise ValueError("a window needs windowed layers, and windowed layers a window")

    @property
    def full(self) -> slice:
        """The canonical layers a continuation reads at every earlier position."""
        return slice(0, self.num_layers - self.window_layers)

    @property
    def windowed(self) -> slice:
        """The canonical layers a continuation reads over its last ``window`` positions only."""
        return slice(self.num_layers - self.window_layers, self.num_layers)

    def block_shape(self, block_tokens: int, layers: slice | None = None) -> tuple[int, int, int, int, int]:
        """A stored value's shape: the ``full`` group's layers unless ``layers`` says otherwise."""
        start, stop, _ = (layers or self.full).indices(self.num_layers)
        return (stop - start, 2, self.num_kv_heads, block_tokens, self.head_dim)

    def window_floor(self, window_from: int, block_size: int) -> int:
        """The fewest tokens of a sequence whose windowed layers hold K/V from block
        ``window_from`` on that another may copy and continue from: it reads ``window``
        positions before its own (``window - 1``, and one more for a first run that begins a
        position early to avoid a length that rounds apart). 0 when every position is held."""
        return window_from * block_size + self.window if window_from and self.window_layers else 0

    def window_blocks(self, run: int, block_size: int, prompt_tokens: int, first: int = 0) -> range:
        """The blocks whose windowed layers a prompt of ``prompt_tokens`` tokens reads when its
        first ``run`` blocks are cached: it continues from c = min(run x block, prompt - 1) (the
        last prompt token always runs), so those holding positions ``c - window .. c - 1`` (its
        first run may begin at c - 1, which reads back to c - window), none before block ``first``."""
        cached = min(run * block_size, prompt_tokens - 1)
        return range(max(first, (cached - self.window) // block_size), -(-cached // block_size))


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
    windows: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """Models with windowed layers: (block index, the windowed layers' canonical K/V) of the
    blocks ``complete_windows`` read that its ``into`` kept. Emptied by ``release``."""
    window_from: int = 0
    """The first block whose windowed layers' K/V is in place (read, or computed by the reader
    before the lookup's first block); 0 for models without windowed layers."""
    window_present: set[int] = field(default_factory=set)
    """Blocks whose windowed layers were read and passed the checks."""

    def release(self) -> None:
        """Drops the fetched values (they are in the slot now), keeping what was found."""
        self.blocks = []
        self.windows = []


class PrefixStore:
    def __init__(self, store: KVStore, geometry: KVGeometry, stats: CacheStats) -> None:
        self.store = store
        self.geometry = geometry
        self.stats = stats

    def hashes(self, namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
        return block_hashes(namespace, token_ids)

    def lookup(self, namespace: Namespace, token_ids: Sequence[int], into: Receiver | None = None) -> PrefixLookup:
        """One batched read of every full block's key, each value checked as it arrives; the run
        stops at the first miss, and a value that fails a check is counted, deleted, and ends the
        run like a miss. With ``into``, block ``i`` of the run goes to ``into(i, block, layers)`` as
        soon as it is checked, before the next value is read, and is kept only if ``into`` returns
        True: a fetch that copies each block into its slot holds one value at a time.

        With windowed layers the same read first asks for the windowed values a continuation after
        the whole prompt's blocks would read (most warm prompts find them all): handed to ``into``
        and noted for ``complete_windows``, which reads what the final run needs beyond them. One
        round trip, not two, whatever the run's length."""
        found = PrefixLookup(hashes=self.hashes(namespace, token_ids), blocks=[])
        size, geometry = namespace.block_size, self.geometry
        ahead = geometry.window_blocks(len(found.hashes), size, len(token_ids)) if geometry.window_layers else ()
        hits = self.extend(found, size, into, windows_ahead=ahead)
        self.stats.add(block_hits=hits, block_misses=len(found.hashes) - hits)
        return found

    def extend(self, found: PrefixLookup, block_size: int, into: Receiver | None = None,
               limit: int | None = None, windows_ahead: Sequence[int] = ()) -> int:
        """Reads on from the end of ``found``'s run (blocks another worker published since), at
        most ``limit`` blocks, as ``lookup`` reads (with ``windows_ahead``, those blocks' windowed
        layers first); adds them to ``found`` and returns how many were added. Not counted as hits
        or misses: ``lookup`` counted the prompt's blocks once."""
        geometry, first = self.geometry, found.hit_blocks
        indices = range(first, len(found.hashes) if limit is None else min(len(found.hashes), first + limit))
        requests = [(i, geometry.windowed) for i in windows_ahead] + [(i, geometry.full) for i in indices]
        hits = 0
        for i, layers, block in self._read(found.hashes, requests, block_size):
            if layers == geometry.full:
                if into is None or into(i, block, layers):
                    found.blocks.append(block)
                hits += 1
            else:
                self._window_read(found, i, block, into)
        found.hit_blocks += hits
        return hits

    def _window_read(self, found: PrefixLookup, i: int, block: np.ndarray, into: Receiver | None) -> None:
        found.window_present.add(i)
        if into is None or into(i, block, self.geometry.windowed):
            found.windows.append((i, block))

    def complete_windows(self, found: PrefixLookup, block_size: int, prompt_tokens: int, into: Receiver | None = None,
                         first: int = 0) -> int:
        """Models with windowed layers, once ``found``'s run is final: reads the windowed layers of
        the blocks a continuation after the run reads (``KVGeometry.window_blocks``; the reader
        holds every block before ``first`` itself) that ``lookup`` did not read already, handing
        each to ``into`` as ``lookup`` does. When one of those values is missing
        or bad, the run ends before that block and the blocks the shorter run needs are read: the
        run only ever shrinks, and each value is read at most once here. Sets ``found.window_from``;
        returns the run's length."""
        geometry, n = self.geometry, found.hit_blocks
        if not geometry.window_layers:
            return n
        read: set[int] = set()  # a value ``lookup`` missed may have come since (a lease wait extended the run)
        while n > first:
            needed = geometry.window_blocks(n, block_size, prompt_tokens, first)
            missing = [i for i in needed if i not in found.window_present and i not in read]
            read.update(missing)
            for i, _, block in self._read(found.hashes, [(i, geometry.windowed) for i in missing], block_size):
                self._window_read(found, i, block, into)
            absent = [i for i in needed if i not in found.window_present]
            if not absent:
                found.window_from = needed.start
                break
            self.stats.add(window_misses=1)
            n = max(absent)
        found.hit_blocks = max(n, first)
        return found.hit_blocks

    def _read(self, hashes: Sequence[BlockHash], requests: Sequence[tuple[int, slice]],
              block_size: int) -> Iterator[tuple[int, slice, np.ndarray]]:
        """Block ``i``'s value of the layer group ``layers`` for each request, in one batched read,
        each checked as it arrives: yields (i, layers, value) for each that passes; a value that
        fails is counted and deleted. The first miss or failure of the ``full`` group ends the read
        (a run is used up to its first gap), not one of a windowed group. Each value is read only
        up to its exact size (the geometry's): a longer one is never transferred whole."""
        if not requests:
            return
        geometry = self.geometry
        # Keyed by whether the layers are the full group (a slice is no dict key before Python 3.12).
        expected = {full: Expected(ValueKind.PREFIX_BLOCK if full else ValueKind.WINDOW_BLOCK, b"", geometry.dtype,
                                   geometry.block_shape(block_size, layers), self.store.authenticated)
                    for full, layers in ((True, geometry.full), (False, geometry.windowed))}
        keys = [(block_key if layers == geometry.full else window_block_key)(hashes[i]) for i, layers in requests]
        sizes = {full: encoded_bytes(e.shape, e.dtype) for full, e in expected.items()}
        rejected = []
        values = self.store.iter_many(keys, [sizes[layers == geometry.full] for _, layers in requests])
        try:
            for (i, layers), key, value in zip(requests, keys, values, strict=False):
                ends_run = layers == geometry.full
                if value is None:
                    if ends_run:
                        break
                    continue
                try:
                    block = decode(value, replace(expected[ends_run], owner=hashes[i]))
                except CodecError as exc:
                    self.stats.count("rejected_values", exc.reason)
                    _rejected.warning("cache value %s rejected (%s); deleted, computing instead", key, exc)
                    rejected.append(key)
                    if ends_run:
                        break
                    continue
                self.stats.add(bytes_read=len(value))
                yield i, layers, block
        finally:
            values.close()  # hands the stream's connection back before the delete needs one
            if rejected:
                self.store.delete(rejected)

    def publish(self, hashes: Sequence[BlockHash], kv: np.ndarray, first_block: int, block_size: int) -> int:
        """Writes blocks ``first_block .. len(hashes)`` under their hashes, set-if-absent; ``kv``
        (canonical, any float dtype) holds exactly those blocks' tokens, from block ``first_block``
        on, and is narrowed to the storage dtype here. A block that would not pass a reader's range
        check once narrowed ends the publish there: later blocks are only reachable through it.
        With windowed layers each block is two values (the module's docstring), both written.
        Returns how many values were new.

        Block ``first_block`` is written last, in a write of its own, once every later block is
        stored: a lookup, which stops at its first miss, finds none of this publish's blocks or
        all of them, never part. A worker arriving mid-publish so stops at ``first_block``, whose
        lease the publisher holds (``services.engine.leases``), not at a block inside the run that
        nobody holds: it would take that block's lease and compute the rest again. One write of
        all the blocks would not do: a Redis pipeline interleaves with other clients' reads once
        its values span several socket reads, and a cluster writes to each node apart."""
        size = block_size
        assert kv.shape[3] == (len(hashes) - first_block) * size, "kv must hold exactly the blocks to publish"
        geometry = self.geometry
        items, windows = [], []
        for i in range(first_block, len(hashes)):
            j = i - first_block
            block = kv[:, :, :, j * size : (j + 1) * size, :].astype(geometry.dtype, copy=False)
            try:
                check_range(block)
            except CodecError as exc:
                _rejected.warning("block %s and later ones not stored (%s)", block_key(hashes[i]), exc)
                break
            items.append((block_key(hashes[i]), encode(ValueKind.PREFIX_BLOCK, hashes[i], block[geometry.full])))
            if geometry.window_layers:
                windows.append((window_block_key(hashes[i]),
                                encode(ValueKind.WINDOW_BLOCK, hashes[i], block[geometry.windowed])))
        # A reader that finds a block's first group finds its second: both are in before the gate.
        gate, run = items[:1], items[1:] + windows
        items += windows
        written = (self.store.put_many(run) if run else 0) + self.store.put_many(gate)
        self.stats.add(blocks_written=written, bytes_sent=sum(len(v) for _, v in items))
        return written
