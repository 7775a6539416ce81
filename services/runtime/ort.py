"""ONNX Runtime, imported in one place so that a missing one is one clear error.

kvshare's base dependencies leave ONNX Runtime out: the ``cpu`` extra installs onnxruntime and the
``gpu`` extra onnxruntime-gpu, two distributions of the same ``onnxruntime`` module that must not
be installed together. An install with neither extra gets this message instead of a bare
"No module named 'onnxruntime'"; ``kvshare`` prints it without a traceback (services/cli.py).
"""

from __future__ import annotations

from onnx import helper

MISSING = ("ONNX Runtime is not installed: install kvshare[cpu] (onnxruntime) or, with CUDA, "
           "kvshare[gpu] (onnxruntime-gpu)")

try:
    import onnxruntime
except ModuleNotFoundError as exc:
    if exc.name != "onnxruntime":
        raise
    raise ModuleNotFoundError(MISSING, name="onnxruntime") from None

def cpu_session(graph, opsets: dict[str, int], threads: int) -> onnxruntime.InferenceSession:
    """A CPU session of a small ``onnx.GraphProto`` built in code, on ``threads`` intra-op threads
    (0: ONNX Runtime's choice). IR version 10: what every ONNX Runtime the images hold reads
    (onnx writes its newest, which onnxruntime-gpu 1.31 refuses)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, v) for domain, v in opsets.items()])
    model.ir_version = 10
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


__all__ = ["cpu_session", "onnxruntime"]
