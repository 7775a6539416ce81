"""What device K/V slots stand on: an ONNX Runtime CUDA session reads and writes CuPy arrays that are
bound to a run by raw device pointer, a row of a larger array included (a pointer plus the row's
byte offset), with no copy through the host and nothing outside the bound bytes touched."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from gpu_probe import add_one_model  # noqa: E402 - the probe's own graph

ROWS, WIDTH = 3, 8


def add_one_session():
    """A CUDA session of ``y = x + 1`` over float16 ``[1, WIDTH]``."""
    import onnxruntime as ort

    model = add_one_model(WIDTH)
    onnx.checker.check_model(onnx.load_from_string(model))
    session = ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider", session.get_providers()
    return session


def test_a_run_reads_and_writes_rows_of_cupy_arrays_in_place():
    import cupy

    session = add_one_session()
    source = cupy.arange(ROWS * WIDTH, dtype=cupy.float16).reshape(ROWS, WIDTH)
    target = cupy.full((ROWS, WIDTH), -1, dtype=cupy.float16)
    # Filled on CuPy's current stream; the session runs on a non-blocking stream of its own, which
    # does not wait for that one: the fills must be done before the run reads them.
    cupy.cuda.get_current_stream().synchronize()
    row_bytes = WIDTH * source.itemsize
    binding = session.io_binding()
    binding.bind_input("x", "cuda", 0, np.float16, [1, WIDTH], source.data.ptr + 2 * row_bytes)
    binding.bind_output("y", "cuda", 0, np.float16, [1, WIDTH], target.data.ptr + 1 * row_bytes)
    session.run_with_iobinding(binding)

    expected = np.full((ROWS, WIDTH), -1, np.float16)
    expected[1] = cupy.asnumpy(source[2]) + 1
    np.testing.assert_array_equal(cupy.asnumpy(target), expected)
