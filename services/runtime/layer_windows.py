"""Which self-attention layers of a decoder graph see only a window of recent positions.

Read from the graph itself, never from a per-model table: a ``com.microsoft::GroupQueryAttention``
node with ``local_window_size`` W > 0 lets the query at position p see keys p - W + 1 .. p (its own
and the W - 1 before it; measured on ONNX Runtime's CPU kernel, the same as llama.cpp's sliding
window of W). A node is matched to its layer by its present-key output, which is the graph output
named for that layer in genai_config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True, slots=True)
class LayerWindows:
    """The graph's sliding-window layers and their window (in positions, the query's own included)."""

    window: int = 0
    """0: every layer reads every earlier position."""
    layers: tuple[int, ...] = ()
    """Indices of the windowed layers, ascending; empty when ``window`` is 0."""


def read_layer_windows(onnx_path: Path, present_keys: list[str]) -> LayerWindows:
    """The windows of the graph in ``onnx_path`` (external data is not read), given each layer's
    present-key output name. Several window sizes in one graph are refused with ValueError: the
    store keeps one windowed layer group. A file onnx cannot parse has no windows here: opening
    the session says what is wrong with it."""
    try:
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except DecodeError:
        return LayerWindows()
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
