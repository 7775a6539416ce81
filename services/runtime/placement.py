"""Refuses a graph whose compute ONNX Runtime would split onto the CPU beside a device.

ONNX Runtime puts a node its device provider has no kernel for on the CPU provider and copies
tensors across at every boundary, silently: on CUDA a float32 ``GroupQueryAttention`` (CUDA's
kernels are float16/bfloat16 only) runs on the CPU with every layer's K/V copied each step.

``session.disable_cpu_ep_fallback`` is not the check to use: it refuses *any* node on the CPU
provider, and ONNX Runtime places small shape subgraphs there on purpose (the ``Shape -> Gather ->
Cast`` that feeds ``GroupQueryAttention``'s ``total_sequence_length``, which its CUDA kernel takes
in host memory), so it would refuse every GQA graph, GenAI's own included. Instead the session
records where each node went (``session.record_ep_graph_assignment_info``) and the compute
operators below must all be on the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from services.errors import ModelLoadError

COMPUTE_OPS = frozenset({
    "Attention", "BiasGelu", "Conv", "Einsum", "Erf", "FastGelu", "Gelu", "Gemm", "GroupQueryAttention",
    "LayerNormalization", "MatMul", "MatMulNBits", "MultiHeadAttention", "PagedAttention", "QuickGelu",
    "RMSNormalization", "RotaryEmbedding", "SimplifiedLayerNormalization", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "Softmax",
})
"""Operators whose work grows with the model and the tokens: on the CPU beside a device they
would be the run's cost. Shape arithmetic, casts of scalars and index gathers may stay on the CPU."""


def check_placement(path: Path, assigned: Iterable[Any], device_provider: str) -> None:
    """Raises ModelLoadError when any compute operator of ``path`` was assigned to a provider
    other than ``device_provider``; the message names the operators and the fix. ``assigned``:
    ``InferenceSession.get_provider_graph_assignment_info()`` (subgraphs with ``ep_name`` and
    ``get_nodes()``, each node with ``op_type``)."""
    stray: dict[str, int] = {}
    for subgraph in assigned:
        if subgraph.ep_name == device_provider:
            continue
        for node in subgraph.get_nodes():
            if node.op_type in COMPUTE_OPS:
                stray[node.op_type] = stray.get(node.op_type, 0) + 1
    if not stray:
        return
    ops = ", ".join(f"{count} {op}" for op, count in sorted(stray.items()))
    fix = ("rebuild it with `kvshare build-model --dtype float16` (CUDA's GroupQueryAttention runs float16 and "
           "bfloat16 only)" if "GroupQueryAttention" in stray
           else "use a graph built for this device, or serve it with --device cpu")
    raise ModelLoadError(f"{path}: {ops} would run on the CPU beside {device_provider}, not on the device: {fix}")
