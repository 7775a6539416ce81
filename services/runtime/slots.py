"""K/V memory as slots: one slot per active sequence of a worker, and the model runs over them.

Two banks share one interface, chosen by what the graph allows:

- ``SharedSlots`` (GroupQueryAttention with a shared past/present buffer, separate K/V tensors; on
  any device): per layer one K and one V buffer ``[max_batch, kv_heads, max_seq, head]`` in the
  session's arrays (``device_arrays``: numpy on the CPU, CuPy on CUDA), bound by pointer as both
  past and present; a slot is one row. A decode step runs every decoding row in *one* model
  run (``seqlens_k`` per row, right-padded, from the attention mask). A prefill chunk runs batch 1
  on its own row (the operator refuses batch > 1 with several new tokens over a past); the row is
  contiguous, so no copy is made. Cached blocks are copied straight into the row, and every copy
  (in, out, within) moves exactly the tokens it needs, counted by the device's ``CopyCounter``.
- ``SequenceSlots`` (graphs that cannot share a buffer: the combined layout, standard-op
  attention, the encoder-decoder decoder): each slot owns a ``KVCache`` and every row runs batch
  1, one after the other.

Invariant of ``SharedSlots.decode``: a run covers rows ``0 .. hi`` where ``hi`` is one past the
highest row decoding, so rows in that range that are not decoding (free, fetching, prefilling or
paused) run too. Each such row is fed one dummy token at its first unwritten position (its
``length``); it writes K/V only there, which that row's own next run overwrites. Its output is
ignored. Slots are handed out lowest index first to keep ``hi`` small. A run never covers a
number of rows that the bank's ``decode_rule`` calls lone (``split_rule``: where a matmul computes
a row alone in its block by a kernel of its own, a decoding row's values would depend on how many
others decode beside it): it takes one row more, a dummy, where the bank has one.

With sliding-window layers (``ModelSpec.windows``), ``SharedSlots`` keeps its layers in the store's
canonical order (``ModelSpec.layer_order``: the layers that read every position, then the windowed
ones), so that each layer group of a block is one slice of the layer axis. A windowed layer's
positions before its window are never read (GroupQueryAttention's ``local_window_size`` masks
them), so a fetch fills them only where a continuation reads them; what a slot holds there
otherwise is another sequence's stale but finite K/V.

One thread (the scheduler's) calls every method, with one exception: the function that
``receiver`` returns copies fetched blocks into a slot from a read thread while the slot fetches. That is
safe because a fetching row's ``length`` is 0 until ``begin``: decode runs in flight write into
its position 0 only, so the receiver leaves block 0 to ``begin`` (scheduler thread, between runs). A row
lock makes ``release`` wait for a copy in progress and stops later ones, so a fetch that outlives
its request never writes into the row's next owner. On a device those copies are only enqueued, on
a stream of their own (``device_arrays.Fetch``): ordered after the slot's ``ready`` mark (taken at
``acquire``, after the previous owner's last copy out), and joined into the compute stream by
``begin``, or by ``release`` for a fetch that never began, before anything else uses the row.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.errors import StartupError
from services.runtime.device_arrays import HostCopy
from services.runtime.memory import populate
from services.runtime.onnx_decoder import DecoderSession, KVCache
from services.runtime.ort import onnxruntime as ort
from services.runtime.split_rule import EVERY_RUN, SplitRule

BlockReceiver = Callable[[int, np.ndarray, slice], bool]
"""Copies block i (canonical K/V of the layers the slice names) into a slot as a lookup reads it
(``cachestore.prefix.Receiver``); True: keep it for ``begin``."""


@dataclass(slots=True, eq=False)
class Slot:
    """One sequence's K/V: ``length`` tokens held, room for ``capacity``."""

    index: int
    capacity: int
    length: int = 0
    cache: KVCache | None = None
    """``SequenceSlots`` only: the sequence's own cache."""
    fetching: bool = False
    """A ``receiver`` may copy into it: from ``receiver`` until ``begin`` or ``release``."""
    ready: Any = None
    """``SharedSlots`` on a device: the compute stream's mark when the slot was handed out."""
    fetch: Any = None
    """``SharedSlots`` on a device: the copies a ``receiver`` enqueued (``device_arrays.Fetch``)."""


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
        slot.fetching = False
        heapq.heappush(self._free, slot.index)

    def receiver(self, slot: Slot) -> BlockReceiver | None:
        """A function for ``PrefixStore.lookup(into=...)`` that copies each fetched block into
        ``slot`` as it arrives, or None when the slot's memory is only made by ``begin``."""
        return None

    def prefault(self, tokens: int) -> int:
        """Faults in the first ``tokens`` positions of the row ``acquire`` hands out first, without
        changing them (``memory.populate``: safe beside running requests). Returns the bytes
        faulted in; 0 where the slots' memory is made per request or lives on a device."""
        return 0

    def warm_up(self) -> None:
        """Runs once, before serving, what a first request would otherwise pay for or fail on
        (see ``SharedSlots.warm_up``); nothing here: these slots' K/V are ONNX Runtime's own."""


def batches_rows(session: DecoderSession) -> bool:
    """Whether ``open_slots`` gives this session ``SharedSlots``, whose rows one decode run batches
    and whose layers are grouped as the store's windowed layer groups are."""
    return session.shares_buffer and session.spec.encoder is None


class SharedSlots(_Bank):
    """Rows of one shared K/V buffer per layer; decode steps batch every decoding row."""

    batched = True

    def __init__(self, session: DecoderSession, max_batch: int, max_seq: int,
                 decode_rule: SplitRule = EVERY_RUN) -> None:
        spec = session.spec
        assert session.shares_buffer and spec.encoder is None, "a GQA shared-buffer decoder-only graph"
        super().__init__(session, max_batch, max_seq)
        self.decode_rule = decode_rule
        self.device = device = session.device
        self._kv = device.zeros([spec.num_layers, 2, max_batch, spec.num_kv_heads, max_seq, spec.head_size],
                                session.kv_dtype)
        self._position = {layer: i for i, layer in enumerate(spec.layer_order)}
        """Where each model layer lies on the buffer's layer axis (grouped: see the module)."""
        self._lengths = np.zeros(max_batch, dtype=np.int64)
        self._logits = device.zeros(self.session.logits_shape(max_batch, 1), session.logits_dtype)
        self._prefill_buffer = None
        self._decode_bindings: dict[int, ort.IOBinding] = {}
        self._row_locks = [threading.Lock() for _ in range(max_batch)]

    def acquire(self, capacity: int) -> Slot:
        slot = super().acquire(capacity)
        slot.ready = self.device.mark()
        return slot

    def release(self, slot: Slot) -> None:
        with self._row_locks[slot.index]:
            super().release(slot)
        # A fetch that never began may still have copies in flight into the row: its next owner's
        # work on the compute stream comes after them.
        self.device.join(slot.fetch)
        slot.fetch = None
        self._lengths[slot.index] = 0

    def prefault(self, tokens: int) -> int:
        if self.device.kind != "cpu":
            return 0
        return populate(self._kv[:, :, 0, :, : min(tokens, self.max_seq)])

    def warm_up(self) -> None:
        """Runs each device operation of the bank once (a prefill, one-row and two-row decodes, a
        copy out, a fork, a beam reorder, a fetched block and a ``begin``) on rows it frees again:
        CuPy compiles each kernel (NVRTC) on its first use with a dtype and rank, so a machine that
        cannot compile them stops the worker here with the reason (StartupError), not in a request,
        and no request pays for compiling. The bank, its lengths and its copy counts are as they were."""
        assert self.max_seq >= 6 and self.free == self.max_batch, "a bank of at least 6 positions, before serving"
        counted = dict(self.device.copied.bytes)
        rows = [self.acquire(6) for _ in range(min(2, self.max_batch))]
        first, last = rows[0], rows[-1]
        try:
            # One token over nothing and two over a past: CuPy reduces a [1, 1] mask to rank 1.
            self.prefill(first, [0])
            self.prefill(first, [0, 0])
            self.decode(rows[:1], [0])
            block = self.canonical(first, 0, 1).result()
            if len(rows) > 1:
                self.fork(first, rows[1:])
                self.decode(rows, [0, 0])
                # Rows swapped, and one row moved (its index arrays broadcast to rank 1).
                self.reorder(rows, np.array([1, 0]), 4)
                self.reorder(rows, np.array([0, 0]), 4)
            self.receiver(last)(1, block, slice(None))
            self.begin(last, [block], 1)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the worker cannot serve: say why, at start
            raise StartupError(
                f"the K/V slots on {self.session.device_name} failed a first run of their device operations "
                f"({type(exc).__name__}: {exc}); on CUDA, CuPy compiles its kernels with NVRTC (libnvrtc.so.13: the "
                "CUDA image has it, else install nvidia-cuda-nvrtc), which needs the CUDA runtime headers: "
                "kvshare[gpu] installs them (nvidia-cuda-runtime), or set CUDA_PATH to a CUDA toolkit") from exc
        finally:
            for slot in rows:
                self.release(slot)
            self.device.copied.restore(counted)

    def receiver(self, slot: Slot) -> BlockReceiver:
        """Copies fetched block ``i`` (canonical ``layers``, any storage dtype) into the slot's
        row, on a read thread (see the module's invariant), except block 0: decode runs in flight
        may write the row's position 0 until ``begin``, so it is kept (returns True) and copied by
        ``begin`` alone: every cached byte crosses once."""
        lock, row = self._row_locks[slot.index], self._kv[:, :, slot.index]
        slot.fetch, slot.fetching = self.device.fetch(slot.ready), True

        def receive(i: int, block: np.ndarray, layers: slice) -> bool:
            if i == 0:
                return True
            n = block.shape[3]
            with lock:
                if slot.fetching:
                    self.device.copy_in(row[layers, :, :, i * n : (i + 1) * n], block, slot.fetch)
            return False

        return receive

    def _blocks_into(self, slot: Slot, start: int, blocks: Sequence[np.ndarray], tokens: int,
                     windows: Sequence[tuple[int, np.ndarray]]) -> None:
        """Copies the first ``tokens - start`` tokens of canonical ``blocks`` into the slot's row
        from position ``start``, and of ``windows`` (block index, the windowed layers of that block)
        the tokens below ``tokens``: one copy per block, exactly the tokens used. A block holds the
        first layers of the canonical axis (every layer, or those before the windowed ones when the
        store splits them off), a window value the last ones."""
        row, offset = self._kv[:, :, slot.index], start
        for block in blocks:
            n = min(block.shape[3], tokens - offset)
            if n <= 0:
                break
            self.device.copy_in(row[: block.shape[0], :, :, offset : offset + n], block[:, :, :, :n])
            offset += n
        for i, block in windows:
            first = i * block.shape[3]
            n = min(block.shape[3], tokens - first)
            if n > 0:
                self.device.copy_in(row[-block.shape[0] :, :, :, first : first + n], block[:, :, :, :n])

    def begin(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int, cross_kv: np.ndarray | None = None,
              windows: Sequence[tuple[int, np.ndarray]] = ()) -> None:
        """Fills the slot with the first ``tokens`` tokens of cached ``blocks`` and ``windows``
        (those a ``receiver`` did not copy: block 0 of a streamed fetch, every block otherwise)."""
        assert cross_kv is None, "encoder-decoder models use SequenceSlots"
        with self._row_locks[slot.index]:
            slot.fetching = False  # a late block of the lookup must not land beside the runs
        self.device.join(slot.fetch)
        slot.fetch = None
        self._blocks_into(slot, 0, blocks, tokens, windows)
        self._set_length(slot, tokens)

    def canonical(self, slot: Slot, start: int, end: int) -> HostCopy:
        """Tokens ``start .. end`` of the slot on their way to the host, canonical
        ``[layers, 2, kv_heads, n, head]``: exactly those tokens are copied."""
        return self.device.copy_out(self._kv, (slice(None), slice(None), slot.index, slice(None), slice(start, end)))

    def append(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int,
               windows: Sequence[tuple[int, np.ndarray]] = ()) -> None:
        """Copies cached ``blocks`` and ``windows`` (as ``begin`` takes them) after the slot's
        tokens, up to ``tokens`` in all (between runs, on the scheduler thread)."""
        assert tokens <= slot.capacity, "append past the slot's capacity"
        self._blocks_into(slot, slot.length, blocks, tokens, windows)
        self._set_length(slot, tokens)

    def _set_length(self, slot: Slot, length: int) -> None:
        slot.length = length
        self._lengths[slot.index] = length

    def rewind(self, slot: Slot, length: int) -> None:
        """Forgets the slot's positions from ``length`` on (the next run writes them again)."""
        assert length <= slot.length, "rewinds only to a position the slot holds"
        self._set_length(slot, length)

    def _bind(self, binding: ort.IOBinding, name: str, array, output: bool = False, first_row: int = 0,
              shape: list[int] | None = None) -> None:
        """Binds ``array`` (in the bank's array module) by pointer, from row ``first_row`` with
        ``shape`` (default: its own)."""
        device = self.device
        pointer = device.pointer(array) + first_row * array[0].nbytes
        bind = binding.bind_output if output else binding.bind_input
        bind(name, device.kind, device.index, array.dtype.type, list(shape or array.shape), pointer)

    def _bind_rows(self, binding: ort.IOBinding, first: int, rows: int) -> None:
        """Binds rows ``first .. first + rows`` of every layer's K and V as both past and present."""
        spec, kv = self.session.spec, self._kv
        shape = [rows, spec.num_kv_heads, self.max_seq, spec.head_size]
        for layer in range(spec.num_layers):
            at = self._position[layer]
            for j in (0, 1):
                self._bind(binding, spec.kv.past[layer][j], kv[at, j], first_row=first, shape=shape)
                self._bind(binding, spec.kv.present[layer][j], kv[at, j], output=True, first_row=first, shape=shape)

    def _bind_inputs(self, binding: ort.IOBinding, ids: np.ndarray, lengths: np.ndarray) -> list:
        """Token ids ``[rows, n]`` after ``lengths`` tokens per row: mask ones over each row's
        past and new tokens (right-padded to the longest row), positions when the graph takes them.
        Built where the session reads them: only ids and lengths cross to a device. Returns the
        arrays bound, which must outlive the run."""
        session, spec, device = self.session, self.session.spec, self.device
        n, xp = ids.shape[1], device.xp
        with device.scope():
            bound = [device.asarray(ids.astype(session.ids_dtype, copy=False))]
            rows = device.asarray(lengths)
            if session.mask_dtype is not None:
                total = int(lengths.max()) + n
                bound.append((xp.arange(total)[None, :] < (rows + n)[:, None]).astype(session.mask_dtype))
            if session.pos_dtype is not None:
                bound.append((rows[:, None] + xp.arange(n)[None, :]).astype(session.pos_dtype))
        names = [spec.input_ids_name]
        names += [spec.attention_mask_name] if session.mask_dtype is not None else []
        names += [spec.position_ids_name] if session.pos_dtype is not None else []
        for name, array in zip(names, bound, strict=True):
            self._bind(binding, name, array)
        return bound

    def prefill(self, slot: Slot, token_ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        """Runs ``token_ids`` after the slot's tokens (batch 1, on its row); the last position's
        logits ``[vocab]`` as float32 (``all_positions``: every position's, ``[n, vocab]``). Only
        the logits asked for come back from a device."""
        n = len(token_ids)
        assert slot.length + n <= slot.capacity, "prefill past the slot's capacity"
        binding = self.session.io_binding()
        logits = self._prefill_logits(n)
        self._bind(binding, self.session.spec.logits_name, logits, output=True)
        self._bind_rows(binding, slot.index, 1)
        bound = self._bind_inputs(binding, np.asarray([token_ids]), self._lengths[slot.index : slot.index + 1])
        self.session.run_binding(binding)
        del bound
        self._set_length(slot, slot.length + n)
        wanted = logits[0] if all_positions or logits.ndim == 2 else logits[0, -1:]
        return self.session.positions_logits(self.device.to_host(wanted), n, all_positions)

    def _prefill_logits(self, n: int):
        """Where a prefill run over ``n`` tokens writes its logits: the front of one buffer kept
        for the longest run so far (a fresh one per run would cost its page faults on the host,
        an allocation on a device). Callers copy what they keep (``positions_logits``)."""
        shape = self.session.logits_shape(1, n)
        size = int(np.prod(shape))
        if self._prefill_buffer is None or self._prefill_buffer.size < size:
            self._prefill_buffer = self.device.zeros([size], self.session.logits_dtype)
        return self._prefill_buffer[:size].reshape(shape)

    def fork(self, source: Slot, targets: Sequence[Slot]) -> None:
        """Gives every target a copy of ``source``'s tokens: each row of the shared buffer is one
        sequence's past, so samples and beams of one prompt each need their own."""
        for target in targets:
            self._copy_row(source, target, 0, source.length)

    def share(self, source: Slot, target: Slot, tokens: int) -> None:
        """Gives ``target``, which holds the first ``target.length`` of them already, ``source``'s
        first ``tokens`` tokens (two sequences whose prompts begin alike)."""
        self._copy_row(source, target, target.length, tokens)

    def _copy_row(self, source: Slot, target: Slot, start: int, end: int) -> None:
        """One plain slice per target (all layers at once), no gathered temporary."""
        assert start <= end <= source.length, "copies only tokens the source holds"
        span = slice(start, end)
        self.device.copy_within(self._kv, (slice(None), slice(None), target.index, slice(None), span),
                                (slice(None), slice(None), source.index, slice(None), span))
        self._set_length(target, end)

    def reorder(self, slots: Sequence[Slot], parents: np.ndarray, shared: int) -> None:
        """Beam search: row ``slots[i]`` becomes a copy of row ``slots[parents[i]]`` (all hold the
        same number of tokens, the first ``shared`` of them identical in every row: the prompt).
        One gather over the rows whose parent is another row, and only their tokens past
        ``shared``, never a loop over beams; the gather reads into a new array first, so a row that
        is both read and overwritten is safe."""
        moved = np.flatnonzero(parents != np.arange(len(slots)))
        if not moved.size or slots[0].length <= shared:  # the first step: every row holds the prompt alone
            return
        rows = np.fromiter((s.index for s in slots), dtype=np.int64, count=len(slots))
        span = slice(shared, slots[0].length)
        self.device.copy_within(self._kv, (slice(None), slice(None), rows[moved], slice(None), span),
                                (slice(None), slice(None), rows[parents[moved]], slice(None), span))

    def _decode_binding(self, rows: int) -> ort.IOBinding:
        """The binding of rows ``0 .. rows``, K/V and logits bound once and kept."""
        binding = self._decode_bindings.get(rows)
        if binding is None:
            binding = self.session.io_binding()
            self._bind(binding, self.session.spec.logits_name, self._logits, output=True,
                       shape=self.session.logits_shape(rows, 1))
            self._bind_rows(binding, 0, rows)
            self._decode_bindings[rows] = binding
        return binding

    def decode(self, slots: Sequence[Slot], tokens: Sequence[int]) -> np.ndarray:
        """One model run that feeds ``tokens[i]`` to ``slots[i]``; returns logits ``[len(slots), vocab]``
        (float32) in the same order: only those rows come back from a device. Rows in range that
        are not in ``slots`` get a dummy token at their own next position (see the module's invariant)."""
        index = np.fromiter((s.index for s in slots), dtype=np.int64, count=len(slots))
        assert all(s.length < s.capacity for s in slots), "decode past a slot's capacity"
        rows = int(index.max()) + 1
        if self.decode_rule.lone(rows) and rows < self.max_batch:
            rows += 1
        ids = np.zeros((rows, 1), dtype=np.int64)
        ids[index, 0] = tokens
        binding = self._decode_binding(rows)
        bound = self._bind_inputs(binding, ids, self._lengths[:rows])
        self.session.run_binding(binding)
        del bound
        with self.device.scope():
            picked = self._logits[self.device.asarray(index)]
        logits = self.device.to_host(picked.reshape(len(slots), -1))
        for slot in slots:
            self._set_length(slot, slot.length + 1)
        return logits.astype(np.float32, copy=False)


class SequenceSlots(_Bank):
    """One ``KVCache`` per slot, each row run batch 1: the layout for graphs ``SharedSlots`` cannot batch."""

    batched = False

    def release(self, slot: Slot) -> None:
        slot.cache = None
        super().release(slot)

    def begin(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int, cross_kv: np.ndarray | None = None,
              windows: Sequence[tuple[int, np.ndarray]] = ()) -> None:
        assert not windows, "the store splits no layer groups for these slots (batches_rows)"
        if tokens:
            slot.cache = self.session.cache_from_blocks(blocks, tokens, slot.capacity)
        else:
            slot.cache = self.session.empty_cache(slot.capacity)
        if cross_kv is not None:
            slot.cache.cross = self.session.cross_values(cross_kv)
        slot.length = tokens

    def canonical(self, slot: Slot, start: int, end: int) -> HostCopy:
        return HostCopy(self.session.to_canonical(slot.cache, end)[:, :, :, start:end])

    def rewind(self, slot: Slot, length: int) -> None:
        assert length <= slot.length, "rewinds only to a position the slot holds"
        self.share(slot, slot, length)

    def append(self, slot: Slot, blocks: Sequence[np.ndarray], tokens: int,
               windows: Sequence[tuple[int, np.ndarray]] = ()) -> None:
        """The slot's tokens and then cached ``blocks``, up to ``tokens`` in all, in a new cache;
        the cross-attention K/V stays."""
        assert not windows, "the store splits no layer groups for these slots (batches_rows)"
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


def open_slots(session: DecoderSession, max_batch: int, max_seq: int, decode_rule: SplitRule = EVERY_RUN) -> SlotBank:
    """The bank that batches this graph best (see the module docstring); ``decode_rule``: the
    batch sizes a batched decode avoids."""
    if batches_rows(session):
        return SharedSlots(session, max_batch, max_seq, decode_rule)
    return SequenceSlots(session, max_batch, max_seq)
