"""Builds the ONNX graph of a Gemma 3 decoder (llama.cpp's ``gemma3``, src/models/gemma3.cpp).

The same contract as decoder_graph.py's Llama graph (``input_ids`` and ``attention_mask`` in,
separate past/present K/V, fused ``GroupQueryAttention`` with the rotary inside), with Gemma's
layer: token embeddings times ``embedding_scale``; RMSNorm over every query and key head before
the half-split rotary; a rotary base per layer (one cos/sin cache per base); windowed layers whose
GroupQueryAttention has ``local_window_size``; RMSNorm after attention and after the MLP as well
as before them; a GeGLU MLP. RMSNorm weights are used as they are (llama.cpp's converter stores
Gemma's ``1 + w``).

Two differences serve a 262,144-token vocabulary: ``logits`` is ``[batch, 1, vocab]``, the last
position of each row only (the engine asks for no other: a prefill of n tokens would otherwise
compute and write n x 1 MiB), and the tied head is a Gemm against the embedding with ``transB``
(a Transpose node would be constant-folded by ONNX Runtime into a second copy of the 671 MB
embedding). Rank 3 with a fixed 1, not ``[batch, vocab]``: ONNX Runtime GenAI (0.18) refuses
rank-2 logits ("Invalid rank for output: logits") and runs this one.
"""

from __future__ import annotations

import numpy as np
import onnx

from services.modelbuild.decoder_graph import (
    attention_lengths,
    decoder_io,
    group_query_attention,
    rope_cache,
)
from services.modelbuild.graph_writer import GraphWriter
from services.modelbuild.presets import DecoderShape
from services.runtime.kv_layout import KVLayout

EMBEDDING = "model.embed_tokens.weight"


def _head_norm(g: GraphWriter, x: str, name: str, shape: DecoderShape) -> str:
    """RMSNorm of every head of ``x`` (``[batch, seq, heads * head_size]``) over its own width."""
    heads = g.node("Reshape", [x, "per_head_shape"], f"{name}.per_head")
    normed = g.rms_norm(heads, name, shape.head_size, shape.rms_eps)
    return g.node("Reshape", [normed, "flat_heads_shape"], f"{name}.flat")


def build_gemma_graph(shape: DecoderShape, seed: int, weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """The Gemma 3 decoder ``shape`` (separate K/V layout, tied head) with seeded weights, or with
    ``weights`` (builder names, all used; matmul weights ``[in, out]``)."""
    if not (shape.qk_norm and shape.post_norms):
        raise ValueError("a Gemma 3 graph has RMSNorm on query and key heads and after attention and MLP")
    layout = KVLayout.SEPARATE
    g = GraphWriter(seed, weights)
    h, d, std = shape.hidden_size, shape.head_size, shape.init_std
    q_width, kv_width = shape.num_heads * d, shape.num_kv_heads * d
    inputs, outputs = decoder_io(shape, layout, ["batch_size", 1, shape.vocab_size])
    ropes: dict[float, tuple[str, str]] = {}
    for base in sorted({shape.rope_base(layer) for layer in range(shape.num_layers)}):
        cos, sin = rope_cache(base, d, shape.context_length)
        ropes[base] = g.const(f"cos_cache_{base:g}", cos), g.const(f"sin_cache_{base:g}", sin)
    attention_lengths(g)
    g.const("per_head_shape", np.array([0, 0, -1, d], np.int64))
    g.const("flat_heads_shape", np.array([0, 0, -1], np.int64))

    embedded = g.node("Gather", [g.weight(EMBEDDING, (shape.vocab_size, h), 1.0), "input_ids"], "embeddings", axis=0)
    x = g.node("Mul", [embedded, g.const("embedding_scale", np.array(shape.embedding_scale, np.float32))], "embeddings_scaled")
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}"
        normed = g.rms_norm(x, f"{p}.input_layernorm", h, shape.rms_eps)
        q = g.node("MatMul", [normed, g.weight(f"{p}.attn.q_proj.weight", (h, q_width), std)], f"{p}.q")
        k = g.node("MatMul", [normed, g.weight(f"{p}.attn.k_proj.weight", (h, kv_width), std)], f"{p}.k")
        v = g.node("MatMul", [normed, g.weight(f"{p}.attn.v_proj.weight", (h, kv_width), std)], f"{p}.v")
        q, k = _head_norm(g, q, f"{p}.attn.q_norm", shape), _head_norm(g, k, f"{p}.attn.k_norm", shape)
        attn = group_query_attention(g, shape, layout, layer, q, k, v, ropes[shape.rope_base(layer)], shape.window(layer))
        o = g.node("MatMul", [attn, g.weight(f"{p}.attn.o_proj.weight", (q_width, h), std)], f"{p}.o")
        o = g.rms_norm(o, f"{p}.post_attention_layernorm", h, shape.rms_eps)
        x = g.node("Add", [x, o], f"{p}.attn_residual")
        normed = g.rms_norm(x, f"{p}.pre_feedforward_layernorm", h, shape.rms_eps)
        mlp = g.gated_mlp(normed, f"{p}.mlp", h, shape.intermediate_size, std, shape.activation)
        mlp = g.rms_norm(mlp, f"{p}.post_feedforward_layernorm", h, shape.rms_eps)
        x = g.node("Add", [x, mlp], f"{p}.mlp_residual")
    # Every position's K/V is written above; only the last position goes on to the head.
    last = g.node("Gather", [x, g.const("last_position", np.array(-1, np.int64))], "last_hidden", axis=1)
    normed = g.rms_norm(last, "model.norm", h, shape.rms_eps)
    head = g.node("Gemm", [normed, EMBEDDING], "last_logits", transB=1)
    g.node("Unsqueeze", [head, "axis1"], "logits")
    if weights:
        raise ValueError(f"weights the graph has no place for: {sorted(weights)[:5]}")
    return g.model("kvshare_gemma3", inputs, outputs)
