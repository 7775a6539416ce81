"""Element-type conversions of K/V between the model's dtype and the store's.

float16 <-> float32 runs through ONNX Runtime's CPU ``Cast`` kernel (vectorised; bit-identical to
numpy's, which converts float16 with scalar code and is about 5x slower here). Other pairs use
numpy: a plain copy when the dtypes match, ``ml_dtypes``' bfloat16 conversions (memory speed)
otherwise.

Widening a stored block into a slot casts it into a scratch buffer of the block's size, owned by
the calling thread and reused, then copies it into the slot's strided rows: ONNX Runtime writes
only contiguous outputs, and a block's tokens are strided in a slot. No request-sized
intermediate is ever made.
"""

from __future__ import annotations

import threading

import numpy as np
from onnx import TensorProto, helper

from services.runtime.ort import cpu_session
from services.runtime.ort import onnxruntime as ort

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
_TENSOR_TYPES = {_F16: TensorProto.FLOAT16, _F32: TensorProto.FLOAT}
_lock = threading.Lock()
_sessions: dict[tuple[np.dtype, np.dtype], ort.InferenceSession] = {}
_local = threading.local()


def _cast_session(src: np.dtype, dst: np.dtype) -> ort.InferenceSession:
    with _lock:
        if (src, dst) not in _sessions:
            graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=_TENSOR_TYPES[dst])], "cast",
                                      [helper.make_tensor_value_info("x", _TENSOR_TYPES[src], ["n"])],
                                      [helper.make_tensor_value_info("y", _TENSOR_TYPES[dst], ["n"])])
            # One thread: callers are the scheduler, read and write threads, one core each.
            _sessions[src, dst] = cpu_session(graph, {"": 21}, 1)
        return _sessions[src, dst]


def prepare(a: np.dtype, b: np.dtype) -> None:
    """Makes the conversion sessions between ``a`` and ``b`` (both ways) now, where they are
    ONNX Runtime's, so that the first fetch or publish does not."""
    a, b = np.dtype(a), np.dtype(b)
    if _by_ort(a, b):
        _cast_session(a, b)
        _cast_session(b, a)


def _by_ort(src: np.dtype, dst: np.dtype) -> bool:
    return {src, dst} == {_F16, _F32}


def _ort_cast(src: np.ndarray, out: np.ndarray) -> None:
    """Casts C-contiguous ``src`` into C-contiguous ``out`` of the same size."""
    bindings = _local.__dict__.setdefault("bindings", {})
    pair = (src.dtype, out.dtype)
    if pair not in bindings:  # one binding per thread and pair, bound again to each call's memory
        session = _cast_session(*pair)
        bindings[pair] = (session, session.io_binding())
    session, binding = bindings[pair]
    binding.bind_input("x", "cpu", 0, src.dtype.type, [src.size], src.ctypes.data)
    binding.bind_output("y", "cpu", 0, out.dtype.type, [out.size], out.ctypes.data)
    session.run_with_iobinding(binding)


def converted(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``array`` in ``dtype`` (itself when it already is), as a new C-contiguous array."""
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    if not _by_ort(array.dtype, dtype):
        return array.astype(dtype)
    out = np.empty(array.shape, dtype)
    _ort_cast(np.ascontiguousarray(array), out)
    return out


def _scratch(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """This thread's reusable buffer, viewed as ``shape`` of ``dtype``."""
    size = int(np.prod(shape)) * dtype.itemsize
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.nbytes < size:
        buffer = _local.buffer = np.empty(size, np.uint8)
    return buffer[:size].view(dtype).reshape(shape)


def cast_into(dest: np.ndarray, block: np.ndarray) -> None:
    """``dest[...] = block`` with the element type converted (``dest`` may be strided). Any pair
    of storage and model dtypes converts, narrowing ones too (bfloat16 stored for a float16
    model): values passed the codec's range check, so they are within float16's range."""
    if block.dtype == dest.dtype or not _by_ort(block.dtype, dest.dtype):
        np.copyto(dest, block, casting="unsafe")
        return
    scratch = _scratch(block.shape, dest.dtype)
    _ort_cast(np.ascontiguousarray(block), scratch)
    np.copyto(dest, scratch)
