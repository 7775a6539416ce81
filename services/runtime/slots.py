"""K/V memory as slots: one slot per active sequence of a worker, and the model runs over them.

Two banks share one interface, chosen by what the graph allows:

- ``SharedSlots`` (GroupQueryAttention with a shared past/present buffer, separate K/V tensors,
  host memory): per layer one K and one V buffer ``[max_batch, kv_heads, max_seq, head]``, bound as
  both past and present; a slot is one row. A decode step runs every decoding row in *one* model
  run (``seqlens_k`` per row, right-padded, from the attention mask). A prefill chunk runs batch 1
  on its own row (the operator refuses batch > 1 with several new tokens over a past); the row is
  contiguous, so no copy is made. Cached blocks are copied straight into the row.
- ``SequenceSlots`` (every other graph: the combined layout, standard-op attention, the
  encoder-decoder decoder, and shared-buffer graphs on a device): each slot owns a ``KVCache`` and
  every row runs batch 1, one after the other.

Invariant of ``SharedSlots.decode``: a run covers rows ``0 .. hi`` where ``hi`` is one past the
highest row decoding, so rows in that range that are not decoding (free, fetching, prefilling or
paused) run too. Each such row is fed one dummy token at its first unwritten position (its
``length``); it writes K/V only there, which that row's own next run overwrites. Its output is
ignored. Slots are handed out lowest index first to keep ``hi`` small.

One thread (the scheduler's) calls every method, with one exception: the function that
``receiver`` returns copies fetched blocks into a slot from a read thread while the slot fetches. That is
safe because a fetching row's ``length`` is 0 until ``begin``: decode runs in flight write into
its position 0 only, and ``begin`` (scheduler thread, between runs) copies block 0 again. A row
lock makes ``release`` wait for a copy in progress and stops later ones, so a fetch that outlives
its request never writes into the row's next owner.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from services.runtime.onnx_decoder import (
    DecoderSession,
    KVCache,
    aligned_zeros,
    blocks_into,
)
from services.runtime.ort import onnxruntime as ort


@dataclass(slots=True, eq=False)
class Slot:
    """One sequence's K/V: ``length`` tokens held, room for ``capacity``."""

    index: int
    capacity: int
    length: int = 0
    cache: KVCache | None = None
    """``SequenceSlots`` only: the sequence's own cache."""
    released: bool = False
    """Given back to the bank; a ``receiver`` copies nothing more into it."""


class _Bank:
    """What both banks share: the session, the sizes, and the free slot indices (lowest first)."""

    def __init__(self, session: DecoderSession, max_batch: int, max_seq: int) -> None:
        self.session = session
        self.max_batch = max_batch
        self.max_seq = max_seq
        self._free = list(range(max_batch))

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self, capacity: int) -> Slot:
        assert capacity <= self.max_seq, f"{capacity} tokens exceed a slot of {self.max_seq}"
        return Slot(heapq.heappop(self._free), capacity)

    def release(self, slot: Slot) -> None:
        slot.released = True
        heapq.heappush(self._free, slot.index)

    def receiver(self, slot: Slot) -> Callable[[int, np.ndarray], bool] | None:
        """A function for ``PrefixStore.lookup(into=...)`` that copies each fetched block into
        ``slot`` as it arrives, or None when the slot's memory is only made by ``begin``."""
        return None


class SharedSlots(_Bank):
    """Rows of one shared K/V buffer per layer; decode steps batch every decoding row."""

    batched = True

    def __init__(self, session: DecoderSession, max_batch: int, max_seq: int) -> None:
        spec = session.spec
        assert session.shares_buffer and session.on_host and spec.encoder is None, "a host GQA shared-buffer graph"
        super().__init__(session, max_batch, max_seq)
        # np.zeros maps pages lazily: memory is committed only as rows are written.
        self._kv = aligned_zeros([spec.num_layers, 2, max_batch, spec.num_kv_heads, max_seq, spec.head_size],
                                 session.kv_dtype)
        self._lengths = np.zeros(max_batch, dtype=np.int64)
        self._row_bytes = self._kv[0, 0, 0].nbytes
        self._logits = np.empty((max_batch, 1, spec.vocab_size), dtype=session.logits_dtype)
        self._decode_bindings: dict[int, ort.IOBinding] = {}
        self._row_locks = [threading.Lock() for _ in range(max_batch)]

    def release(self, slot: Slot) -> None:
        with self._row_locks[slot.index]:
            super().release(slot)
        self._lengths[slot.index] = 0

    def receiver(self, slot: Slot) -> Callable[[int, np.ndarray], bool]:
        """Copies fetched block ``i`` (canonical, any storage dtype) into the slot's row, on a read
        thread (see the module's invariant). Returns True for block 0 only: ``begin`` must be
        given it, to copy it again over what decode runs in flight may have written."""
        lock, row = self._row_locks[slot.index], self._kv[:, :, slot.index]

        def receive(i: int, block: np.ndarray) -> bool:
            n = block.shape[3]
            with lock:
                if not slot.released:
                    blocks_into(row[:, :, :, i * n : (i + 1) * n], [block], n)
            return i == 0

        return receive

    def begin(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int, cross_kv: np.ndarray | None = None) -> None:
        """Fills the slot with the first ``tokens`` tokens of cached ``blocks``."""
        assert cross_kv is None, "encoder-decoder models use SequenceSlots"
        blocks_into(self._kv[:, :, slot.index], blocks, tokens)
        self._set_length(slot, tokens)

    def canonical(self, slot: Slot, start: int, end: int) -> np.ndarray:
        """A copy of tokens ``start .. end`` of the slot, canonical ``[layers, 2, kv_heads, n, head]``."""
        return np.ascontiguousarray(self._kv[:, :, slot.index, :, start:end])

    def append(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int) -> None:
        """Copies cached ``blocks`` (canonical, any storage dtype) after the slot's tokens, up to
        ``tokens`` in all (between runs, on the scheduler thread)."""
        assert tokens <= slot.capacity, "append past the slot's capacity"
        blocks_into(self._kv[:, :, slot.index, :, slot.length : tokens], blocks, tokens - slot.length)
        self._set_length(slot, tokens)

    def _set_length(self, slot: Slot, length: int) -> None:
        slot.length = length
        self._lengths[slot.index] = length

    def _bind_rows(self, binding: ort.IOBinding, first: int, rows: int) -> None:
        """Binds rows ``first .. first + rows`` of every layer's K and V as both past and present."""
        spec, kv = self.session.spec, self._kv
        shape = [rows, spec.num_kv_heads, self.max_seq, spec.head_size]
        element = self.session.kv_dtype.type
        for layer in range(spec.num_layers):
            for j in (0, 1):
                pointer = kv[layer, j].ctypes.data + first * self._row_bytes
                binding.bind_input(spec.kv.past[layer][j], "cpu", 0, element, shape, pointer)
                binding.bind_output(spec.kv.present[layer][j], "cpu", 0, element, shape, pointer)

    def _bind_inputs(self, binding: ort.IOBinding, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Token ids ``[rows, n]`` after ``lengths`` tokens per row: mask ones over each row's
        past and new tokens (right-padded to the longest row), positions when the graph takes them."""
        session, spec = self.session, self.session.spec
        n = ids.shape[1]
        binding.bind_cpu_input(spec.input_ids_name, ids.astype(session.ids_dtype, copy=False))
        if session.mask_dtype is not None:
            total = int(lengths.max()) + n
            mask = (np.arange(total)[None, :] < (lengths + n)[:, None]).astype(session.mask_dtype)
            binding.bind_cpu_input(spec.attention_mask_name, mask)
        if session.pos_dtype is not None:
            positions = (lengths[:, None] + np.arange(n)[None, :]).astype(session.pos_dtype)
            binding.bind_cpu_input(spec.position_ids_name, positions)

    def prefill(self, slot: Slot, token_ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        """Runs ``token_ids`` after the slot's tokens (batch 1, on its row); the last position's
        logits ``[vocab]`` as float32 (``all_positions``: every position's, ``[n, vocab]``)."""
        n = len(token_ids)
        assert slot.length + n <= slot.capacity, "prefill past the slot's capacity"
        binding = self.session.io_binding()
        binding.bind_output(self.session.spec.logits_name, "cpu")
        self._bind_rows(binding, slot.index, 1)
        self._bind_inputs(binding, np.asarray([token_ids]), self._lengths[slot.index : slot.index + 1])
        self.session.run_binding(binding)
        logits = binding.get_outputs()[0].numpy()
        self._set_length(slot, slot.length + n)
        return self.session.positions_logits(logits, n, all_positions)

    def fork(self, source: Slot, targets: Sequence[Slot]) -> None:
        """Gives every target a copy of ``source``'s tokens: each row of the shared buffer is one
        sequence's past, so samples and beams of one prompt each need their own (one copy per
        layer for all targets)."""
        self._copy_rows(source, targets, 0, source.length)

    def share(self, source: Slot, target: Slot, tokens: int) -> None:
        """Gives ``target``, which holds the first ``target.length`` of them already, ``source``'s
        first ``tokens`` tokens (two sequences whose prompts begin alike)."""
        self._copy_rows(source, [target], target.length, tokens)

    def _copy_rows(self, source: Slot, targets: Sequence[Slot], start: int, end: int) -> None:
        assert start <= end <= source.length, "copies only tokens the source holds"
        rows = [t.index for t in targets]
        if len(rows) == 1:  # a plain slice, no gathered temporary: the common case of a shared prefix
            self._kv[:, :, rows[0], :, start:end] = self._kv[:, :, source.index, :, start:end]
        else:
            self._kv[:, :, rows, :, start:end] = self._kv[:, :, source.index : source.index + 1, :, start:end]
        for target in targets:
            self._set_length(target, end)

    def reorder(self, slots: Sequence[Slot], parents: np.ndarray, shared: int) -> None:
        """Beam search: row ``slots[i]`` becomes a copy of row ``slots[parents[i]]`` (all hold the
        same number of tokens, the first ``shared`` of them identical in every row: the prompt).
        One gather per layer over the rows whose parent is another row, and only their tokens past
        ``shared``, never a loop over beams; the gather reads into a new array first, so a row that
        is both read and overwritten is safe."""
        moved = np.flatnonzero(parents != np.arange(len(slots)))
        if not moved.size:
            return
        rows = np.fromiter((s.index for s in slots), dtype=np.int64, count=len(slots))
        n = slots[0].length
        self._kv[:, :, rows[moved], :, shared:n] = self._kv[:, :, rows[parents[moved]], :, shared:n]

    def _decode_binding(self, rows: int) -> ort.IOBinding:
        """The binding of rows ``0 .. rows``, K/V and logits bound once and kept."""
        binding = self._decode_bindings.get(rows)
        if binding is None:
            binding = self.session.io_binding()
            spec = self.session.spec
            if self.session.logits_rank == 3:
                binding.bind_output(spec.logits_name, "cpu", 0, self._logits.dtype.type, [rows, 1, spec.vocab_size],
                                    self._logits.ctypes.data)
            else:
                binding.bind_output(spec.logits_name, "cpu")
            self._bind_rows(binding, 0, rows)
            self._decode_bindings[rows] = binding
        return binding

    def decode(self, slots: Sequence[Slot], tokens: Sequence[int]) -> np.ndarray:
        """One model run that feeds ``tokens[i]`` to ``slots[i]``; returns logits ``[len(slots), vocab]``
        (float32) in the same order. Rows in range that are not in ``slots`` get a dummy token at
        their own next position (see the module's invariant)."""
        index = np.fromiter((s.index for s in slots), dtype=np.int64, count=len(slots))
        assert all(s.length < s.capacity for s in slots), "decode past a slot's capacity"
        rows = int(index.max()) + 1
        ids = np.zeros((rows, 1), dtype=np.int64)
        ids[index, 0] = tokens
        binding = self._decode_binding(rows)
        self._bind_inputs(binding, ids, self._lengths[:rows])
        self.session.run_binding(binding)
        if self.session.logits_rank == 3:
            logits = self._logits[index, 0]
        else:
            out = binding.get_outputs()[0].numpy()
            logits = out.reshape(rows, -1, out.shape[-1])[index, -1]
        for slot in slots:
            self._set_length(slot, slot.length + 1)
        return logits.astype(np.float32, copy=False)


class SequenceSlots(_Bank):
    """One ``KVCache`` per slot, each row run batch 1: the layout for graphs ``SharedSlots`` cannot batch."""

    batched = False

    def release(self, slot: Slot) -> None:
        slot.cache = None
        super().release(slot)

    def begin(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int, cross_kv: np.ndarray | None = None) -> None:
        if tokens:
            slot.cache = self.session.cache_from_blocks(blocks, tokens, slot.capacity)
        else:
            slot.cache = self.session.empty_cache(slot.capacity)
        if cross_kv is not None:
            slot.cache.cross = self.session.cross_values(cross_kv)
        slot.length = tokens

    def canonical(self, slot: Slot, start: int, end: int) -> np.ndarray:
        return self.session.to_canonical(slot.cache, end)[:, :, :, start:end]

    def append(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int) -> None:
        """The slot's tokens and then cached ``blocks``, up to ``tokens`` in all, in a new cache;
        the cross-attention K/V stays."""
        cross = slot.cache.cross
        slot.cache = self.session.cache_from_blocks([self.session.to_canonical(slot.cache, slot.length), *blocks],
                                                    tokens, slot.capacity)
        slot.cache.cross = cross
        slot.length = tokens

    def prefill(self, slot: Slot, token_ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        logits, slot.cache = self.session.run(token_ids, slot.cache, all_positions=all_positions)
        slot.length = slot.cache.length
        return logits

    def fork(self, source: Slot, targets: Sequence[Slot]) -> None:
        for target in targets:
            target.cache = self._copy(source.cache)
            target.length = source.length

    def share(self, source: Slot, target: Slot, tokens: int) -> None:
        """``target`` gets ``source``'s first ``tokens`` tokens in a cache of its own capacity; its
        cross-attention K/V (the same encoder input: it is in both prompts' namespace) stays."""
        cross = target.cache.cross
        target.cache = self.session.cache_from_blocks([self.session.to_canonical(source.cache, tokens)], tokens,
                                                      target.capacity)
        target.cache.cross = cross
        target.length = tokens

    def reorder(self, slots: Sequence[Slot], parents: np.ndarray, shared: int) -> None:
        caches = [slots[p].cache for p in parents]
        for slot, cache in zip(slots, caches, strict=True):
            slot.cache = self._copy(cache)

    def _copy(self, cache: KVCache) -> KVCache:
        """A cache the holder may extend without touching ``cache``. Without a shared buffer every
        step returns new tensors and leaves the old ones as they were, so rows can share one; with
        one, steps write in place and each row needs its own copy."""
        if not self.session.shares_buffer:
            return cache
        copy = self.session.cache_from_blocks([self.session.to_canonical(cache, cache.length)], cache.length,
                                              cache.capacity)
        copy.cross = cache.cross
        return copy

    def decode(self, slots: Sequence[Slot], tokens: Sequence[int]) -> np.ndarray:
        return np.stack([self.prefill(slot, [token]) for slot, token in zip(slots, tokens, strict=True)])


SlotBank = SharedSlots | SequenceSlots


def open_slots(session: DecoderSession, max_batch: int, max_seq: int) -> SlotBank:
    """The bank that batches this graph best (see the module docstring)."""
    if session.shares_buffer and session.on_host and session.spec.encoder is None:
        return SharedSlots(session, max_batch, max_seq)
    return SequenceSlots(session, max_batch, max_seq)
