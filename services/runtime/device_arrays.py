"""Where a worker keeps K/V: the one module that knows which device it is.

The batched slot bank (``slots.SharedSlots``) holds its buffers in an array module: numpy on the
CPU provider, CuPy on CUDA. Everything device-specific is here and small: allocate, a pointer to
bind, copy in (host block to device, widening its dtype), copy out (device to host), copy within
(device to device), and the providers a session needs to run on the same memory. The bank's code
(indexing, gathers, the decode binding) is the same on both, and the CPU tests exercise it.

Every copy of K/V counts its bytes by direction in ``CopyCounter`` (exported as
``kvshare_slot_copy_bytes_total``): what a copy moves is what it needed, never a whole-capacity
buffer.

Ordering on CUDA (docs/design.md, "Two streams, ordered by events"): ONNX Runtime runs on the
stream CuPy copies on (``user_compute_stream``), so a copy enqueued before a run is ordered before
that run's kernels and a copy enqueued after it reads what the run wrote. Copies into a slot that a read thread makes
while the slot fetches (``Fetch``) go on a second stream, so they overlap the runs instead of
waiting for the one in flight: the first waits for the slot's ``mark`` (an event taken on the
compute stream when the slot was handed out, after its previous owner's last copy out and every
run that wrote its row), and ``join`` makes the compute stream wait for them, on the device, when
the row joins a step. Nothing waits on the host but a copy out's consumer (``HostCopy.result``, on
a write thread) and a run's logits, which sampling needs; pinned staging is kept until the event
of its transfer has passed.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.errors import StartupError
from services.runtime.device_budget import DeviceBudget
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

    def restore(self, counts: dict[str, int]) -> None:
        """Sets the counts back to ``counts`` (a copy of ``bytes`` taken earlier)."""
        with self._lock:
            self.bytes.update(counts)


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

    provider = "CPUExecutionProvider"
    budget = None
    """Host memory is not split: the user sizes the slots (``--kv-cache-bytes``)."""

    def __init__(self) -> None:
        self.copied = CopyCounter()

    def session_providers(self, arena_bytes: int) -> list[Any]:
        """The providers of a session (``arena_bytes``: its share of ``budget.arenas``; unused here)."""
        return [self.provider]

    def unavailable(self, got: str) -> str:
        return f"ONNX Runtime runs this session on {got}, not on {self.provider}"

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

    def mark(self) -> None:
        """Nothing to order on the host: every copy is done when it returns."""
        return None

    def fetch(self, after: None) -> None:
        return None

    def join(self, fetch: None) -> None:
        """Nothing to wait for: see ``mark``."""

    def copy_in(self, dest: np.ndarray, block: np.ndarray, fetch: None = None) -> None:
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


@dataclass(slots=True, eq=False)
class Fetch:
    """Copies into one slot from the read threads of its fetch (``CudaArrays.copy_in`` with it),
    on the device's fetch stream: the first waits for ``after``, the slot's ``mark``."""

    after: Any
    started: bool = False
    """A copy was enqueued: ``join`` has something to wait for."""


class CudaArrays:
    """CuPy arrays on one CUDA device: ONNX Runtime's runs and the scheduler thread's copies on one
    stream (``stream``), read threads' copies into fetching slots on another (``fetch_stream``)."""

    kind = "cuda"
    provider = "CUDAExecutionProvider"

    def __init__(self, index: int, budget: DeviceBudget, cupy_module: Any = None) -> None:
        """``budget``: the device's memory split (``device_budget``); CuPy's pool is capped at its
        bank, each session's arena at its share of its arenas. ``cupy_module``: CuPy, or a stand-in
        with the same calls (the CPU tests' counting device)."""
        cupy = cupy_module or importlib.import_module("cupy")
        self.xp = cupy
        self.index = index
        self.budget = budget
        self.copied = CopyCounter()
        self._device = cupy.cuda.Device(index)
        self._device.use()
        # Non-blocking, as ORT's own would be: ordered only against itself, not the legacy stream.
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.fetch_stream = cupy.cuda.Stream(non_blocking=True)
        cupy.get_default_memory_pool().set_limit(size=budget.bank)
        self.default_kv_cache_bytes = budget.slot_default
        self._staged: list[tuple[Any, np.ndarray]] = []
        self._staged_lock = threading.Lock()

    def session_providers(self, arena_bytes: int) -> list[Any]:
        return [(self.provider, {
            "device_id": str(self.index),
            "user_compute_stream": str(self.stream.ptr),
            "gpu_mem_limit": str(arena_bytes),
            "arena_extend_strategy": "kSameAsRequested",
            # EXHAUSTIVE (ONNX Runtime's default) benchmarks every convolution algorithm on first use:
            # seconds on a request's path for Whisper's encoder. The heuristic picks at once.
            "cudnn_conv_algo_search": "HEURISTIC",
        })]

    def unavailable(self, got: str) -> str:
        """One line for a session that ONNX Runtime put on ``got`` instead of its CUDA provider."""
        return f"ONNX Runtime could not create its CUDA provider on cuda:{self.index} and would run on {got}: " + \
            cuda_provider_failure()

    def scope(self) -> _Scope:
        """This device and the compute stream current on this thread: CuPy work inside is ordered with the runs."""
        return _Scope(self._device, self.stream)

    def _wait(self, done: Any) -> None:
        """Waits on the host for event ``done``, on any thread: with this device current first
        (a thread's first CUDA call would otherwise make a context on device 0)."""
        self._device.use()
        done.synchronize()

    def zeros(self, shape: list[int], dtype: np.dtype) -> Any:
        with self.scope():
            return self.xp.zeros(shape, dtype=dtype)

    def pointer(self, array: Any) -> int:
        return array.data.ptr

    def asarray(self, host: np.ndarray) -> Any:
        with self.scope():
            return self.xp.asarray(host)

    def mark(self) -> Any:
        """An event on the compute stream: what is enqueued there now comes before it."""
        with self.scope():
            return self.stream.record()

    def fetch(self, after: Any) -> Fetch:
        return Fetch(after)

    def join(self, fetch: Fetch | None) -> None:
        """The compute stream waits (on the device) for every copy ``fetch`` enqueued."""
        if fetch is not None and fetch.started:
            self._device.use()
            self.stream.wait_event(self.fetch_stream.record())

    def _pinned(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Page-locked host memory; with this device current, so a read thread makes no context on
        device 0 (CUDA's default on a new thread)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        self._device.use()
        memory = self.xp.cuda.alloc_pinned_memory(max(1, count * dtype.itemsize))
        return np.frombuffer(memory, dtype, count).reshape(shape)

    def _keep(self, done: Any, staging: np.ndarray) -> None:
        """Holds ``staging`` until event ``done`` has passed: CuPy's pinned pool would hand the
        memory out again while the transfer still reads it. Drops those whose transfer is done."""
        with self._staged_lock:
            self._staged = [(event, held) for event, held in self._staged if not event.done]
            self._staged.append((done, staging))

    def copy_in(self, dest: Any, block: np.ndarray, fetch: Fetch | None = None) -> None:
        """``dest[...] = block`` through pinned staging, without waiting for it on the host: on the
        compute stream, or with ``fetch`` on the fetch stream after the fetching slot's mark."""
        stream = self.stream if fetch is None else self.fetch_stream
        staging = self._pinned(dest.shape, dest.dtype)
        cast_into(staging, block)
        with _Scope(self._device, stream):
            if fetch is not None and not fetch.started:
                stream.wait_event(fetch.after)
                fetch.started = True
            # The temporary goes back to CuPy's pool on return; the pool is per stream, so whatever
            # reuses it is ordered after this copy.
            device = self.xp.empty(dest.shape, dtype=dest.dtype)
            device.set(staging, stream=stream)
            dest[...] = device
            self._keep(stream.record(), staging)
        self.copied.add("in", staging.nbytes)

    def copy_out(self, array: Any, key: tuple) -> HostCopy:
        with self.scope():
            gathered = self.xp.ascontiguousarray(array[key])
            host = self._pinned(gathered.shape, gathered.dtype)
            gathered.get(stream=self.stream, out=host, blocking=False)
            # A write thread waits on it: blocking, so that it sleeps instead of spinning a core.
            done = self.stream.record(self.xp.cuda.Event(block=True, disable_timing=True))
        self.copied.add("out", host.nbytes)
        return HostCopy(host, lambda: self._wait(done))

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
    """The device made current on this thread for good, and the stream for the duration (CuPy's
    are thread-local). The device is not restored on exit: CuPy's ``Device.__exit__`` would set
    the thread's previous device, device 0 on a new thread, and since CUDA 12 setting a device
    makes its context, so a worker on ``cuda:N`` would hold a context on device 0 too."""

    def __init__(self, device: Any, stream: Any) -> None:
        self._device, self._stream = device, stream

    def __enter__(self) -> None:
        self._device.use()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)


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


CUDA_LIBRARIES = ("libcuda.so.1", "libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10")
"""What the CUDA provider of onnxruntime-gpu 1.31 (built for CUDA 13) needs to load at all (its
library's NEEDED entries). cuDNN 9 and cuFFT it opens on demand: ``ON_DEMAND_CUDA_LIBRARIES``."""
ON_DEMAND_CUDA_LIBRARIES = ("libcudnn.so.9", "libcufft.so.12")
"""Opened by the CUDA provider at its first convolution (cuDNN) or FFT (cuFFT): Whisper's encoder."""


def missing_cuda_libraries(names: tuple[str, ...] = CUDA_LIBRARIES) -> list[str]:
    """Those of ``names`` the dynamic loader cannot load here."""
    missing = []
    for name in names:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return missing


def cuda_provider_failure() -> str:
    """Why ONNX Runtime's CUDA provider could not be created here, as far as the loader tells."""
    missing = missing_cuda_libraries()
    why = (f"{', '.join(missing)} cannot be loaded (install onnxruntime-gpu's cuda extra or CUDA 13's runtime, "
           "cuBLAS and cuRAND on the library path, and an NVIDIA driver)" if missing else
           "the libraries it needs load, so ONNX Runtime's own log line above names the cause")
    if on_demand := missing_cuda_libraries(ON_DEMAND_CUDA_LIBRARIES):
        why += f"; {', '.join(on_demand)}, which its convolutions and FFTs open, cannot be loaded either"
    return why


_opened: dict[int, CudaArrays] = {}
_opened_lock = threading.Lock()


def open_device(choice: DeviceChoice) -> ArrayDevice:
    """The arrays for ``choice``; ``auto`` is CUDA device 0 when it can be used, else the CPU.
    CUDA asked for and not usable raises StartupError with the reason (no silent fallback).

    A CUDA device is opened once per process: its budget is split from the memory free then, and
    CuPy's pool limit (one per device and process) set once."""
    if choice.kind == "cpu":
        return HostArrays()
    problem = cuda_problem(choice.index)
    if problem is not None:
        if choice.kind == "auto":
            return HostArrays()
        raise StartupError(f"--device {choice}: {problem}")
    import cupy

    with _opened_lock:
        if choice.index not in _opened:
            cupy.cuda.Device(choice.index).use()
            free, _total = cupy.cuda.runtime.memGetInfo()
            _opened[choice.index] = CudaArrays(choice.index, DeviceBudget.split(free))
        return _opened[choice.index]
