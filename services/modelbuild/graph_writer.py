"""A small writer for ONNX graphs with seeded (or given) weights, shared by the model builders."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 17
MS_DOMAIN = "com.microsoft"


class GraphWriter:
    """Accumulates nodes and seeded initializers in a fixed order (so the bytes are reproducible)."""

    def __init__(self, seed: int, weights: dict[str, np.ndarray] | None = None) -> None:
        """``weights``: real values by name, used (and removed from the dict) instead of seeded ones;
        every weight the graph asks for must be there, with the shape it asks for."""
        self.rng = np.random.default_rng(seed)
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def _given(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        values = self.weights.pop(name, None)
        if values is None:
            raise ValueError(f"the weights have no {name}")
        if values.shape != shape:
            raise ValueError(f"{name} has shape {values.shape}, the graph needs {shape}")
        return values

    def weight(self, name: str, shape: tuple[int, ...], std: float) -> str:
        if self.weights is not None:
            values = self._given(name, shape)
        else:
            values = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def const(self, name: str, values: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def node(self, op: str, inputs: list[str], output: str, domain: str = "", **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, domain=domain, **attrs))
        return output

    def rms_norm(self, x: str, name: str, width: int, eps: float) -> str:
        given = self.weights is not None
        weight = self.const(f"{name}.weight", self._given(f"{name}.weight", (width,)) if given else np.ones(width, np.float32))
        return self.node("SimplifiedLayerNormalization", [x, weight], name, axis=-1, epsilon=eps)

    def gated_mlp(self, x: str, prefix: str, width: int, inner: int, std: float, activation: str = "silu") -> str:
        """down(act(x @ gate) * (x @ up)): SwiGLU with ``silu``, GeGLU with ``gelu_tanh`` (GELU's
        tanh approximation, ONNX Runtime's FastGelu)."""
        gate = self.node("MatMul", [x, self.weight(f"{prefix}.gate_proj.weight", (width, inner), std)], f"{prefix}.gate")
        up = self.node("MatMul", [x, self.weight(f"{prefix}.up_proj.weight", (width, inner), std)], f"{prefix}.up")
        if activation == "silu":
            act = self.node("Mul", [gate, self.node("Sigmoid", [gate], f"{prefix}.gate_sigmoid")], f"{prefix}.silu")
        elif activation == "gelu_tanh":
            act = self.node("FastGelu", [gate], f"{prefix}.gelu", domain=MS_DOMAIN)
        else:
            raise ValueError(f"activation {activation!r} has no graph")
        name = "swiglu" if activation == "silu" else "geglu"
        return self.node("MatMul", [self.node("Mul", [act, up], f"{prefix}.{name}"),
                                    self.weight(f"{prefix}.down_proj.weight", (inner, width), std)], f"{prefix}.down")

    def model(self, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
            producer_name="kvshare",
            producer_version="1",
        )
        model.ir_version = 8
        return model
