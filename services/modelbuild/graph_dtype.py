"""Converts a float32 ONNX model to another floating element type (``kvshare build-model --dtype``).

It does what ONNX Runtime GenAI's model builder does for its fp16 and bf16 models (its
``io_dtype``, src/python/py/models/builders/base.py): every float tensor of the graph takes the
chosen type, with no float32 islands. That covers the weights, the RMSNorm weights (GenAI's
``layernorm_attrs["cast"]["use_fp32"]`` is False for Llama), the rotary cos/sin caches
(GroupQueryAttention takes them in its query's type), the past and present K/V, the
cross-attention K/V and the logits. The one exception is also GenAI's: a bfloat16 model's logits
stay float32 ("Always use float32 logits to improve accuracy in the case of bf16 models"), through
one Cast after the head. Norms and softmax get no float32 Casts of their own: GenAI adds none for
Llama, ONNX Runtime's half-precision norm, softmax and attention kernels accumulate in float32, and
the gap measured against the float32 folder (tests/test_model_dtype.py) is about the rounding of
the float16 logits themselves.

A float32 initializer value beyond the new type's largest finite value (the encoder-decoder's -1e9
mask) becomes that value with its sign, as onnxconverter-common's float16 converter does, so that a
finite graph stays finite.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from services.modelbuild.presets import MODEL_DTYPES

_ELEMENT_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
_NUMPY_TYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_LOGITS = "logits"
"""The logits output of every graph the builders write (and of GenAI's)."""
_FLOAT32_LOGITS = ("bfloat16",)


def _narrowed(tensor: TensorProto, dtype: str) -> TensorProto:
    values = numpy_helper.to_array(tensor)
    limit = float(ml_dtypes.finfo(_NUMPY_TYPES[dtype]).max)
    narrowed = np.clip(values, -limit, limit).astype(_NUMPY_TYPES[dtype])
    out = helper.make_tensor(tensor.name, _ELEMENT_TYPES[dtype], values.shape, narrowed.tobytes(), raw=True)
    out.doc_string = tensor.doc_string
    return out


def _retype(values, element_type: int) -> None:
    for value in values:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = element_type


def convert_model(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """``model`` (float32, no subgraphs) with every float32 tensor in ``dtype``: initializers, graph
    inputs and outputs, value infos, tensor attributes (Constant, ConstantOfShape) and Casts to
    float, except a bfloat16 model's ``logits`` output, which stays float32. float32 returns
    ``model`` itself."""
    if dtype == "float32":
        return model
    if dtype not in _ELEMENT_TYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
    element_type = _ELEMENT_TYPES[dtype]
    converted = onnx.ModelProto()
    converted.CopyFrom(model)
    graph = converted.graph
    for i, tensor in enumerate(graph.initializer):
        if tensor.data_type == TensorProto.FLOAT:
            graph.initializer[i].CopyFrom(_narrowed(tensor, dtype))
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH or attr.type == AttributeProto.GRAPHS:
                raise ValueError(f"{node.name}: graphs with subgraphs ({node.op_type}) are not converted")
            if attr.type == AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_narrowed(attr.t, dtype))
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = element_type
    for values in (graph.input, graph.output, graph.value_info):
        _retype(values, element_type)
    if dtype in _FLOAT32_LOGITS and any(o.name == _LOGITS for o in graph.output):
        _float32_output(graph, _LOGITS, dtype)
    return converted


def _float32_output(graph: onnx.GraphProto, name: str, dtype: str) -> None:
    """Renames what produces output ``name`` and appends a Cast of it to float32 under ``name``."""
    inner = f"{name}_{dtype}"
    for node in graph.node:
        node.output[:] = [inner if out == name else out for out in node.output]
        node.input[:] = [inner if x == name else x for x in node.input]
    graph.node.append(helper.make_node("Cast", [inner], [name], name=f"{name}_float32", to=TensorProto.FLOAT))
    output = next(o for o in graph.output if o.name == name)
    output.type.tensor_type.elem_type = TensorProto.FLOAT
