"""What the worker reads from a decoder graph itself: which self-attention layers see only a
window of recent positions, and whether its matmuls quantize their activations.

Read from the graph itself, never from a per-model table: a ``com.microsoft::GroupQueryAttention``
node with ``local_window_size`` W > 0 lets the query at position p see keys p - W + 1 .. p (its own
and the W - 1 before it; measured on ONNX Runtime's CPU kernel, the same as llama.cpp's sliding
window of W). A node is matched to its layer by its present-key output, which is the graph output
named for that layer in genai_config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

MS_DOMAIN = "com.microsoft"
"""The domain of ONNX Runtime's contrib operators; here, not in ``ort``, so that reading a graph
needs no ONNX Runtime (the CLI builds its parser without one)."""


@dataclass(frozen=True, slots=True)
class LayerWindows:
    """The graph's sliding-window layers and their window (in positions, the query's own included)."""

    window: int = 0
    """0: every layer reads every earlier position."""
    layers: tuple[int, ...] = ()
    """Indices of the windowed layers, ascending; empty when ``window`` is 0."""


def read_layer_windows(graph: onnx.GraphProto, present_keys: list[str]) -> LayerWindows:
    """The windows of ``graph``, given each layer's present-key output name. Several window sizes
    in one graph are refused with ValueError: the store keeps one windowed layer group."""
    layer_of = {name: i for i, name in enumerate(present_keys)}
    windows: dict[int, int] = {}
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN or len(node.output) < 2:
            continue
        size = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
        layer = layer_of.get(node.output[1])
        if size > 0 and layer is not None:
            windows[layer] = size
    if not windows:
        return LayerWindows()
    sizes = set(windows.values())
    if len(sizes) > 1:
        raise ValueError(f"layers have different sliding windows {sorted(sizes)}: one window size is supported")
    return LayerWindows(window=sizes.pop(), layers=tuple(sorted(windows)))


_QUANTIZING_OPS = {("", "DynamicQuantizeLinear"), (MS_DOMAIN, "DynamicQuantizeMatMul"),
                   (MS_DOMAIN, "DynamicQuantizeLSTM"), (MS_DOMAIN, "MatMulIntegerToFloat")}
"""Nodes that quantize activations at run time whatever their attributes (ONNX Runtime's
``quantize_dynamic`` writes them)."""


def quantizes_activations(graph: onnx.GraphProto) -> bool:
    """Whether a matmul of ``graph`` rounds its activations to 8 bits (``MatMulNBits`` with
    ``accuracy_level`` 4, as ``--weights gguf`` and ``int8`` folders have, or the dynamic
    quantization nodes of ``_QUANTIZING_OPS``). Such a graph turns a
    small change of its K/V into whole quantization steps of the next activations: SmolLM2 (gguf)
    answered from float16-stored K/V with logits up to 0.83 from computing, from float32-stored
    K/V identically, so the store keeps float32 for it (``--cache-dtype auto``)."""
    return any((node.domain, node.op_type) in _QUANTIZING_OPS or
               (node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN and
                any(a.name == "accuracy_level" and a.i == 4 for a in node.attribute)) for node in graph.node)
