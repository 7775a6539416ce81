"""ONNX Runtime, imported in one place so that a missing one is one clear error.

kvshare's base dependencies leave ONNX Runtime out: the ``cpu`` extra installs onnxruntime and the
``gpu`` extra onnxruntime-gpu, two distributions of the same ``onnxruntime`` module that must not
be installed together. An install with neither extra gets this message instead of a bare
"No module named 'onnxruntime'"; ``kvshare`` prints it without a traceback (services/cli.py).
"""

from __future__ import annotations

MISSING = ("ONNX Runtime is not installed: install kvshare[cpu] (onnxruntime) or, with CUDA, "
           "kvshare[gpu] (onnxruntime-gpu)")

try:
    import onnxruntime
except ModuleNotFoundError as exc:
    if exc.name != "onnxruntime":
        raise
    raise ModuleNotFoundError(MISSING, name="onnxruntime") from None

__all__ = ["onnxruntime"]
