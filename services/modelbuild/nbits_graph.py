"""Rewrites a float decoder graph so that its matmuls read a GGUF's own blocks
(services/modelbuild/gguf_blocks.py) through ``com.microsoft::MatMulNBits``.

The graph builders write every weight as float32; this pass swaps each matmul whose weight has
blocks for a MatMulNBits on them and drops the float copy. Three shapes of matmul are recognised:
``MatMul(x, W)`` on an ``[in, out]`` initializer (the projections), ``MatMul(x, Transpose(E))``
(Llama's tied head) and ``Gemm(x, E, transB=1)`` (Gemma's), the last two on the embedding, whose
float copy stays for the Gather. A weight with per-block minimums (``Q4_1``) also gets
``ReduceSum`` of ``x`` over each block times the minimums, one block sum per distinct ``x``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from services.modelbuild.gguf_blocks import QuantBlocks
from services.modelbuild.graph_writer import MS_DOMAIN

ACCURACY_LEVEL = 4
"""MatMulNBits' ``accuracy_level``: int8 activations, quantized per block of 32 on the fly, as
llama.cpp quantizes them to Q8 for its Q4/Q8 dot products. Measured on SmolLM2 (Q4_1, 2 threads,
decode after 1,024 tokens): 59 tok/s, against 46 with level 1 (float32 activations) for the 4-bit
weights; ONNX Runtime 1.32 has no packed float-activation kernel for 8 bits on x86 (2.3 tok/s)."""


def _blocked_weight(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], initializers: set[str]) -> str | None:
    """The initializer whose blocks ``node`` multiplies by, or None for any other node."""
    if node.op_type == "MatMul" and node.input[1] in initializers:
        return node.input[1]
    if node.op_type == "MatMul" and node.input[1] in producers:
        t = producers[node.input[1]]
        perm = next((helper.get_attribute_value(a) for a in t.attribute if a.name == "perm"), None)
        if t.op_type == "Transpose" and list(perm or ()) == [1, 0] and t.input[0] in initializers:
            return t.input[0]
    if node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] in initializers:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs == {"transB": 1}:
            return node.input[1]
    return None


def use_blocks(model: onnx.ModelProto, blocks: dict[str, QuantBlocks]) -> list[str]:
    """Rewrites ``model`` in place: every matmul on a weight named in ``blocks`` becomes a
    MatMulNBits; float weights left unused are removed. Returns the names of the weights
    rewritten, in graph order."""
    graph = model.graph
    _fuse_siblings(graph, blocks)
    initializers = {t.name for t in graph.initializer} | set(blocks)
    producers = {out: node for node in graph.node for out in node.output}
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    block_sums: dict[str, str] = {}
    rewritten: list[str] = []
    for node in graph.node:
        weight = _blocked_weight(node, producers, initializers)
        qb = blocks.get(weight) if weight is not None else None
        if qb is None:
            nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        n, k = qb.shape
        if weight not in rewritten:
            added += [numpy_helper.from_array(qb.data, f"{weight}.nbits"),
                      numpy_helper.from_array(qb.scales, f"{weight}.scales")]
            if qb.mins is not None:
                added.append(numpy_helper.from_array(np.ascontiguousarray(qb.mins.T), f"{weight}.mins"))
            rewritten.append(weight)
        product = f"{y}.nbits" if qb.mins is not None else y
        nodes.append(helper.make_node("MatMulNBits", [x, f"{weight}.nbits", f"{weight}.scales"], [product],
                                      name=f"{y}.MatMulNBits", domain=MS_DOMAIN, K=k, N=n, bits=qb.bits,
                                      block_size=qb.block_size, accuracy_level=ACCURACY_LEVEL))
        if qb.mins is not None:
            nodes += _block_sum(x, qb.block_size, block_sums, added)
            offsets = helper.make_node("MatMul", [block_sums[x], f"{weight}.mins"], [f"{y}.mins"], name=f"{y}.mins")
            nodes += [offsets, helper.make_node("Add", [product, f"{y}.mins"], [y], name=f"{y}.add_mins")]
    _replace_nodes(graph, nodes, added)
    return rewritten


def _fuse_siblings(graph: onnx.GraphProto, blocks: dict[str, QuantBlocks]) -> None:
    """MatMuls that read the same input and whose weights' blocks agree (bits, block size,
    minimums or none) become one MatMul on their weights side by side (added to ``blocks``) and a
    Split that gives back each output; a GroupQueryAttention whose query, key and value are such a
    Split's outputs takes the product packed instead. Fewer, wider kernels: one MatMulNBits, one
    block sum and one minimums product per group rather than per weight (SmolLM2: 4 groups per
    layer instead of 7 matmuls)."""
    initializers = {t.name for t in graph.initializer}
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in graph.node:
        qb = blocks.get(node.input[1]) if node.op_type == "MatMul" and node.input[1] in initializers else None
        if qb is not None:
            groups.setdefault((node.input[0], qb.bits, qb.block_size, qb.mins is None), []).append(node)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for (x, *_), siblings in groups.items():
        if len(siblings) < 2:
            continue
        fused, product = f"{x}.fused_weight", f"{x}.fused"
        parts = [blocks[n.input[1]] for n in siblings]
        blocks[fused] = QuantBlocks.stacked(parts)
        outputs = [n.output[0] for n in siblings]
        matmul = helper.make_node("MatMul", [x, fused], [product], name=product)
        attention = [r for r in readers.get(outputs[0], []) if r.op_type == "GroupQueryAttention"]
        if len(outputs) == 3 and attention and list(attention[0].input[:3]) == outputs and \
                all(readers[o] == attention for o in outputs):
            attention[0].input[:3] = [product, "", ""]
            split = []
        else:
            widths = numpy_helper.from_array(np.array([p.shape[0] for p in parts], np.int64), f"{x}.fused_widths")
            graph.initializer.append(widths)
            split = [helper.make_node("Split", [product, widths.name], outputs, name=f"{x}.split", axis=-1)]
        replaced[id(siblings[0])] = [matmul, *split]
        replaced.update({id(n): [] for n in siblings[1:]})
    nodes = [new for node in graph.node for new in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)


def _block_sum(x: str, block: int, sums: dict[str, str], added: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """The nodes (none if made before) that sum ``x`` (``[batch, seq, K]``) over each block of
    ``block`` values into ``sums[x]`` (``[batch, seq, K / block]``)."""
    if x in sums:
        return []
    shape, axes = f"block_shape_{block}", "block_sum_axes"
    if not any(t.name == shape for t in added):
        added += [numpy_helper.from_array(np.array([0, 0, -1, block], np.int64), shape),
                  numpy_helper.from_array(np.array([-1], np.int64), axes)]
    sums[x] = f"{x}.block_sums"
    return [helper.make_node("Reshape", [x, shape], [f"{x}.blocks"], name=f"{x}.blocks"),
            helper.make_node("ReduceSum", [f"{x}.blocks", axes], [sums[x]], name=sums[x], keepdims=0)]


def _replace_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], added: list[onnx.TensorProto]) -> None:
    """Sets the graph's nodes, drops nodes whose outputs nothing reads any more (the head's
    Transpose) and initializers nothing reads, and appends ``added``."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for node in nodes for i in node.input} | outputs
        kept = [node for node in nodes if any(o in read for o in node.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    del graph.node[:]
    graph.node.extend(nodes)
    kept_initializers = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept_initializers + added)
