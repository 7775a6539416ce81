"""Where a worker keeps K/V: the one module that knows which device it is.

The batched slot bank (``slots.SharedSlots``) holds its buffers in an array module: numpy on the
CPU provider, CuPy on CUDA. Everything device-specific is here and small: allocate, a pointer to
bind, copy in (host block to device, widening its dtype), copy out (device to host), copy within
(device to device), and the providers a session needs to run on the same memory. The bank's code
(indexing, gathers, the decode binding) is the same on both, and the CPU tests exercise it.

Every copy of K/V counts its bytes by direction in ``CopyCounter`` (exported as
``kvshare_slot_copy_bytes_total``): what a copy moves is what it needed, never a whole-capacity
buffer.

Ordering on CUDA (see docs/design.md, "One stream"): ONNX Runtime runs on the stream CuPy copies
on (``user_compute_stream``), so a copy enqueued before a run is ordered before that run's kernels
and a copy enqueued after it reads what the run wrote. Only three things wait on the host: a copy
in waits for its own host-to-device transfer before its pinned staging is reused; a copy out hands
the write thread an event to wait on (``HostCopy.result``); and a run's logits, which sampling needs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.errors import StartupError
from services.runtime.device_choice import DeviceChoice
from services.runtime.kv_cast import cast_into

DIRECTIONS = ("in", "out", "within")


@dataclass(slots=True)
class CopyCounter:
    """Bytes of K/V copied into slots (``in``: host to slot), out of them (``out``: slot to host)
    and between them (``within``), since start. Thread-safe: read threads copy in."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[direction] += nbytes


class HostCopy:
    """A copy out of the slots on its way to host memory; ``result()`` waits for it (on CUDA, for
    its event) and returns the host array. Taken on the scheduler thread, waited on by a write thread."""

    def __init__(self, array: np.ndarray, wait: Callable[[], None] | None = None) -> None:
        self._array = array
        self._wait = wait

    def result(self) -> np.ndarray:
        if self._wait is not None:
            self._wait()
            self._wait = None
        return self._array


def aligned_zeros(shape: list[int], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """Zeros whose data starts on an ``alignment``-byte boundary.

    ONNX Runtime's CPU kernels read K/V faster from 64-byte aligned memory than from numpy's
    default 16-byte alignment (measured: decode tokens/s). np.zeros maps fresh zero pages lazily,
    so a large capacity costs nothing until it is written.
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.zeros(count + alignment // dtype.itemsize, dtype=dtype)
    offset = (-raw.ctypes.data % alignment) // dtype.itemsize
    return raw[offset : offset + count].reshape(shape)


class HostArrays:
    """numpy arrays in host memory, for sessions on the CPU provider."""

    kind = "cpu"
    index = 0
    xp = np

    default_kv_cache_bytes = 2 << 30
    """``--kv-cache-bytes`` when it is 0: host memory is not measured, the user sizes it."""

    def __init__(self) -> None:
        self.copied = CopyCounter()

    @property
    def providers(self) -> list[Any]:
        return ["CPUExecutionProvider"]

    def zeros(self, shape: list[int], dtype: np.dtype) -> np.ndarray:
        return aligned_zeros(shape, dtype)

    def pointer(self, array: np.ndarray) -> int:
        return array.ctypes.data

    def scope(self) -> contextlib.nullcontext:
        """Nothing to make current on the host."""
        return contextlib.nullcontext()

    def asarray(self, host: np.ndarray) -> np.ndarray:
        """A small model input (ids, mask, positions) where the session reads it."""
        return host

    def copy_in(self, dest: np.ndarray, block: np.ndarray) -> None:
        """``dest[...] = block`` (``dest`` a view into the slots, maybe strided), ``block``'s dtype
        widened or narrowed to the slots'."""
        cast_into(dest, block)
        self.copied.add("in", dest.nbytes)

    def copy_out(self, array: np.ndarray, key: tuple) -> HostCopy:
        """A contiguous host copy of ``array[key]``."""
        out = np.array(array[key], order="C", copy=True)
        self.copied.add("out", out.nbytes)
        return HostCopy(out)

    def copy_within(self, array: np.ndarray, dest: tuple, src: tuple) -> None:
        """``array[dest] = array[src]``; a gather (an index array in ``src``) reads into a
        temporary first, so rows both read and overwritten are safe."""
        values = array[src]
        array[dest] = values
        self.copied.add("within", values.nbytes)

    def to_host(self, array: np.ndarray) -> np.ndarray:
        """A model output (logits) on the host: no K/V, not counted."""
        return array


class CudaArrays:
    """CuPy arrays on one CUDA device, every copy and every ONNX Runtime run on one stream."""

    kind = "cuda"

    def __init__(self, index: int, pool_bytes: int, arena_bytes: int) -> None:
        """``pool_bytes`` caps CuPy's pool (the slot bank and staging), ``arena_bytes`` ONNX
        Runtime's arena (weights and activations): two budgets, so the two allocators cannot both
        grow into the same free memory."""
        import cupy

        self.xp = cupy
        self.index = index
        self.copied = CopyCounter()
        self._device = cupy.cuda.Device(index)
        with self._device:
            # Non-blocking, as ORT's own would be: ordered only against itself, not the legacy stream.
            self.stream = cupy.cuda.Stream(non_blocking=True)
            cupy.get_default_memory_pool().set_limit(size=pool_bytes)
        self._arena_bytes = arena_bytes
        # A tenth of the pool stays for pinned-staging's device side and gathers.
        self.default_kv_cache_bytes = pool_bytes * 9 // 10

    @property
    def providers(self) -> list[Any]:
        return [("CUDAExecutionProvider", {
            "device_id": str(self.index),
            "user_compute_stream": str(self.stream.ptr),
            "gpu_mem_limit": str(self._arena_bytes),
            "arena_extend_strategy": "kSameAsRequested",
        })]

    def scope(self) -> _Scope:
        """This device and the stream current on this thread: CuPy work inside is ordered with the runs."""
        return _Scope(self._device, self.stream)

    def zeros(self, shape: list[int], dtype: np.dtype) -> Any:
        with self.scope():
            return self.xp.zeros(shape, dtype=dtype)

    def pointer(self, array: Any) -> int:
        return array.data.ptr

    def asarray(self, host: np.ndarray) -> Any:
        with self.scope():
            return self.xp.asarray(host)

    def _pinned(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        memory = self.xp.cuda.alloc_pinned_memory(max(1, count * dtype.itemsize))
        return np.frombuffer(memory, dtype, count).reshape(shape)

    def copy_in(self, dest: Any, block: np.ndarray) -> None:
        staging = self._pinned(dest.shape, dest.dtype)
        cast_into(staging, block)
        with self.scope():
            device = self.xp.empty(dest.shape, dtype=dest.dtype)
            device.set(staging, stream=self.stream)
            dest[...] = device
            # The pinned staging goes back to CuPy's pool when this returns: the transfer must be done.
            self.stream.synchronize()
        self.copied.add("in", staging.nbytes)

    def copy_out(self, array: Any, key: tuple) -> HostCopy:
        with self.scope():
            gathered = self.xp.ascontiguousarray(array[key])
            host = self._pinned(gathered.shape, gathered.dtype)
            gathered.get(stream=self.stream, out=host, blocking=False)
            done = self.stream.record()
        self.copied.add("out", host.nbytes)
        return HostCopy(host, done.synchronize)

    def copy_within(self, array: Any, dest: tuple, src: tuple) -> None:
        with self.scope():
            values = array[self._on_device(src)]
            array[self._on_device(dest)] = values
        self.copied.add("within", values.nbytes)

    def _on_device(self, key: tuple) -> tuple:
        """``key`` with its index arrays (the rows of a gather) moved to the device."""
        return tuple(self.xp.asarray(k) if isinstance(k, np.ndarray) else k for k in key)

    def to_host(self, array: Any) -> np.ndarray:
        with self.scope():
            return self.xp.asnumpy(array, stream=self.stream)


class _Scope:
    """The device and stream current on this thread for the duration (CuPy's are thread-local)."""

    def __init__(self, device: Any, stream: Any) -> None:
        self._device, self._stream = device, stream

    def __enter__(self) -> None:
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


ArrayDevice = HostArrays | CudaArrays


def cuda_problem(index: int) -> str | None:
    """Why CUDA device ``index`` cannot run a worker here, or None when it can."""
    from services.runtime.ort import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return ("this ONNX Runtime has no CUDA provider: install kvshare[gpu] (onnxruntime-gpu and CuPy) in place of "
                "kvshare[cpu] (pip uninstall onnxruntime first: both install the module onnxruntime)")
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (install kvshare[gpu])"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no CUDA device can be used ({exc})"
    if index >= count:
        return f"CUDA device {index} does not exist ({count} found)"
    if hasattr(ort, "preload_dlls"):
        # CUDA and cuDNN from NVIDIA's pip wheels where those are installed (a no-op where the
        # system has them, as in the CUDA image): ONNX Runtime does not search site-packages
        # itself. Only once a GPU is known: without one it prints a line per library it misses.
        ort.preload_dlls()
    return None


POOL_SHARE, ARENA_SHARE = 0.5, 0.4
"""Of a CUDA device's free memory at start: CuPy's pool (K/V slots, whose default budget is most
of it), ONNX Runtime's arena (weights, activations); the rest is the CUDA context, cuBLAS and
cuDNN workspaces, which neither allocator sees."""


def open_device(choice: DeviceChoice) -> ArrayDevice:
    """The arrays for ``choice``; ``auto`` is CUDA device 0 when it can be used, else the CPU.
    CUDA asked for and not usable raises StartupError with the reason (no silent fallback)."""
    if choice.kind == "cpu":
        return HostArrays()
    problem = cuda_problem(choice.index)
    if problem is not None:
        if choice.kind == "auto":
            return HostArrays()
        raise StartupError(f"--device {choice}: {problem}")
    import cupy

    with cupy.cuda.Device(choice.index):
        free, _total = cupy.cuda.runtime.memGetInfo()
    return CudaArrays(choice.index, int(free * POOL_SHARE), int(free * ARENA_SHARE))
