"""The counting device: a stand-in for the calls ``device_arrays.CudaArrays`` makes of CuPy, on
host memory, that logs every stream operation with the stream and the thread that made it.

It does not run anything asynchronously (every copy is done when it returns), so it cannot show a
race; it shows the order of operations the code asks CUDA for, which is what decides whether a
real device would race: which stream a copy is enqueued on, which events it waits for, and which
thread waits on the host for what. Data land where a device's would, so the same tests check them.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import numpy as np

_ids = itertools.count(1)


@dataclass
class Op:
    what: str  # "record", "wait", "synchronize", "h2d", "d2h", "kernel", "pinned"
    stream: str | None
    thread: str
    event: int | None = None
    device: int | None = None


@dataclass
class Counting:
    ops: list[Op] = field(default_factory=list)
    local: threading.local = field(default_factory=threading.local)

    def add(self, what: str, stream: Stream | None, event: int | None = None) -> None:
        self.ops.append(Op(what, stream.name if stream else None, threading.current_thread().name, event,
                           getattr(self.local, "device", None)))

    def current_stream(self) -> Stream | None:
        return getattr(self.local, "stream", None)


class Event:
    def __init__(self, log: Counting, stream: Stream | None = None, block: bool = False) -> None:
        self.id, self.stream, self._log, self.block = next(_ids), stream, log, block
        self.done = False
        """Set by a test to say the device got past it."""

    def synchronize(self) -> None:
        self._log.add("synchronize", self.stream, self.id)
        self.done = True


class Stream:
    def __init__(self, log: Counting, non_blocking: bool = False) -> None:
        assert non_blocking, "CudaArrays' streams are non-blocking"
        self._log, self.ptr = log, next(_ids)
        self.name = f"stream{self.ptr}"

    def record(self, event: Event | None = None) -> Event:
        event = event or Event(self._log)
        event.stream = self
        self._log.add("record", self, event.id)
        return event

    def wait_event(self, event: Event) -> None:
        self._log.add("wait", self, event.id)

    def synchronize(self) -> None:
        self._log.add("synchronize", self)

    def __enter__(self) -> Stream:
        self._saved = self._log.current_stream()
        self._log.local.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        self._log.local.stream = self._saved


class Device:
    def __init__(self, log: Counting, index: int) -> None:
        self._log, self.index = log, index

    def use(self) -> None:
        self._log.local.device = self.index


class _Pointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class DeviceArray(np.ndarray):
    """A "device" array: host memory, with CuPy's pointer, transfers, and a logged kernel per write."""

    log: Counting

    @property
    def data(self) -> _Pointer:  # CuPy's MemoryPointer: .ptr
        return _Pointer(self.ctypes.data)

    def set(self, host: np.ndarray, stream: Stream | None = None) -> None:
        self.log.add("h2d", stream)
        np.ndarray.__setitem__(self, Ellipsis, host)

    def get(self, stream: Stream | None = None, out: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
        self.log.add("d2h", stream)
        out[...] = self
        return out

    def __setitem__(self, key, value) -> None:
        self.log.add("kernel", self.log.current_stream())
        np.ndarray.__setitem__(self, key, value)


class _Pool:
    def __init__(self) -> None:
        self.limit = None

    def set_limit(self, size: int) -> None:
        self.limit = size


class CountingCupy:
    """The module: ``cupy.cuda.*``, the array functions CudaArrays uses, and ``log``."""

    def __init__(self) -> None:
        self.log = Counting()
        log = self.log
        self.array_type = type("LoggedArray", (DeviceArray,), {"log": log})
        self.pool = _Pool()
        self.pinned: list[bytearray] = []

        class cuda:  # noqa: N801 - CuPy's name
            @staticmethod
            def Device(index: int) -> Device:  # noqa: N802
                return Device(log, index)

            @staticmethod
            def Stream(non_blocking: bool = False) -> Stream:  # noqa: N802
                return Stream(log, non_blocking)

            @staticmethod
            def Event(block: bool = False, disable_timing: bool = False) -> Event:  # noqa: N802
                return Event(log, block=block)

            @staticmethod
            def alloc_pinned_memory(size: int) -> bytearray:
                log.add("pinned", None)
                memory = bytearray(size)
                self.pinned.append(memory)
                return memory

        self.cuda = cuda

    def get_default_memory_pool(self) -> _Pool:
        return self.pool

    def _device(self, array: np.ndarray) -> DeviceArray:
        return np.asarray(array).view(self.array_type)

    def zeros(self, shape, dtype) -> DeviceArray:
        return self._device(np.zeros(shape, dtype))

    def empty(self, shape, dtype) -> DeviceArray:
        return self._device(np.empty(shape, dtype))

    def asarray(self, host) -> DeviceArray:
        return self._device(np.array(host))

    def ascontiguousarray(self, array) -> DeviceArray:
        self.log.add("kernel", self.log.current_stream())
        return self._device(np.ascontiguousarray(array))

    def asnumpy(self, array, stream: Stream | None = None) -> np.ndarray:
        self.log.add("d2h", stream)
        return np.array(array)
