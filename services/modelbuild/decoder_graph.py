"""Builds the ONNX graph of a seeded Llama-shaped decoder, and holds the decoder contract that
gemma_graph.py's Gemma 3 graph shares: its inputs and outputs, the attention lengths, the rotary
caches and the GroupQueryAttention node.

Attention is ONNX Runtime's fused ``com.microsoft::GroupQueryAttention`` (rotary inside the op,
positions derived from the attention mask), the same contract as ONNX Runtime GenAI's own model
builder: inputs ``input_ids`` int64 ``[batch, seq]`` and ``attention_mask`` int64
``[batch, past + seq]``, no ``position_ids``. Measured against the same weights with attention from
standard ops (bench preset, CPU, 2 threads): 1024-token prefill 0.85x the time, decode after a
1024-token prompt 1.25-2.2x the tokens/s of the textbook graph that expands K/V heads, and the
same graph contract as folders from GenAI's builder, so one engine path serves both.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from services.modelbuild.graph_writer import MS_DOMAIN, GraphWriter
from services.modelbuild.presets import DecoderShape
from services.runtime.kv_layout import KVLayout


def past_names(layout: KVLayout, layer: int) -> list[str]:
    if layout is KVLayout.SEPARATE:
        return [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
    return [f"past_{layer}"]


def present_names(layout: KVLayout, layer: int) -> list[str]:
    if layout is KVLayout.SEPARATE:
        return [f"present.{layer}.key", f"present.{layer}.value"]
    return [f"present_{layer}"]


def rope_cache(theta: float, head_size: int, context_length: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's rotary caches ``[context_length, head_size / 2]`` (cos, sin) for base
    ``theta``: the half-split (NEOX) rotary of ``rotary_interleaved=0``."""
    half = head_size // 2
    inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2 / head_size))
    angles = np.outer(np.arange(context_length, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def local_window_size(window: int) -> int:
    """GroupQueryAttention's ``local_window_size`` for a layer whose query at position p sees the
    ``window`` keys p - window + 1 .. p (llama.cpp masks p - p0 >= window). ONNX Runtime's CPU
    kernel (1.32) counts the query's own key in it, in a prefill and over a past alike: measured
    by tests/test_gemma_graph.py against a numpy reference."""
    return window


def decoder_io(shape: DecoderShape, layout: KVLayout, logits_dims: list) -> tuple[list, list]:
    """The graph inputs and outputs of the decoder contract: ``input_ids`` and ``attention_mask``
    (int64), every layer's past K/V in, ``logits`` (``logits_dims``) and every present K/V out."""
    d, kv = shape.head_size, shape.num_kv_heads
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, logits_dims)]
    kv_dims = ["batch_size", kv, "past_sequence_length", d]
    present_dims = ["batch_size", kv, "total_sequence_length", d]
    prefix = [2] if layout is KVLayout.COMBINED else []
    for layer in range(shape.num_layers):
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, prefix + kv_dims) for n in past_names(layout, layer)]
        outputs += [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, prefix + present_dims) for n in present_names(layout, layer)
        ]
    return inputs, outputs


def attention_lengths(g: GraphWriter) -> None:
    """Adds ``seqlens_k`` and ``total_sequence_length``, GroupQueryAttention's per-sequence index
    of the last valid token and the total length, both derived from the attention mask."""
    g.const("one_i64", np.array([1], dtype=np.int64))
    g.const("axis1", np.array([1], dtype=np.int64))
    mask_sum = g.node("ReduceSum", ["attention_mask", "axis1"], "mask_sum", keepdims=0)
    seqlens = g.node("Sub", [mask_sum, "one_i64"], "seqlens_k_i64")
    g.node("Cast", [seqlens], "seqlens_k", to=TensorProto.INT32)
    mask_shape = g.node("Shape", ["attention_mask"], "mask_shape")
    total = g.node("Gather", [mask_shape, "one_i64"], "total_len_1d", axis=0)
    total_scalar = g.node("Squeeze", [total], "total_len_i64")
    g.node("Cast", [total_scalar], "total_sequence_length", to=TensorProto.INT32)


def group_query_attention(g: GraphWriter, shape: DecoderShape, layout: KVLayout, layer: int, q: str, k: str, v: str,
                          rope: tuple[str, str], window: int = 0) -> str:
    """Layer ``layer``'s fused attention over its past and the new ``q``/``k``/``v`` (rotary
    applied inside, from the caches named ``rope``), writing its present K/V; returns the output
    ``[batch, seq, num_heads * head_size]``. ``window``: keys a query sees at most (0: all). The
    scale is the op's default, 1/sqrt(head_size)."""
    p = f"model.layers.{layer}"
    if layout is KVLayout.SEPARATE:
        past_k, past_v = past_names(layout, layer)
        present_k, present_v = present_names(layout, layer)
    else:
        past = past_names(layout, layer)[0]
        past_k = g.node("Gather", [past, g.const(f"{p}.k_index", np.array(0, np.int64))], f"{p}.past_k", axis=0)
        past_v = g.node("Gather", [past, g.const(f"{p}.v_index", np.array(1, np.int64))], f"{p}.past_v", axis=0)
        present_k, present_v = f"{p}.present_k", f"{p}.present_v"
    attrs = {"local_window_size": local_window_size(window)} if window else {}
    g.nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [q, k, v, past_k, past_v, "seqlens_k", "total_sequence_length", *rope],
            [f"{p}.attn_out", present_k, present_v],
            name=f"{p}.GroupQueryAttention",
            domain=MS_DOMAIN,
            num_heads=shape.num_heads,
            kv_num_heads=shape.num_kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            **attrs,
        )
    )
    if layout is KVLayout.COMBINED:
        axis0 = g.const(f"{p}.axis0", np.array([0], np.int64))
        stacked = [g.node("Unsqueeze", [t, axis0], f"{t}_stacked") for t in (present_k, present_v)]
        g.node("Concat", stacked, present_names(layout, layer)[0], axis=0)
    return f"{p}.attn_out"


def build_decoder_graph(shape: DecoderShape, layout: KVLayout, seed: int, weights: dict[str, np.ndarray] | None = None,
                        tied_head: bool = False) -> onnx.ModelProto:
    """Returns the Llama decoder as an ONNX model with seeded weights (same arguments, same bytes),
    or with ``weights`` (builder names, all used). ``tied_head``: the output head is the token
    embedding, transposed in the graph rather than stored twice. Logits ``[batch, seq, vocab]``."""
    if shape.gemma_features():
        raise ValueError(f"a Llama graph has no {', '.join(shape.gemma_features())}: build it with gemma_graph")
    g = GraphWriter(seed, weights)
    h, d, kv = shape.hidden_size, shape.head_size, shape.num_kv_heads
    std = shape.init_std
    inputs, outputs = decoder_io(shape, layout, ["batch_size", "sequence_length", shape.vocab_size])
    cos, sin = rope_cache(shape.rope_theta, d, shape.context_length)
    rope = g.const("cos_cache", cos), g.const("sin_cache", sin)
    attention_lengths(g)

    x = g.node("Gather", [g.weight("model.embed_tokens.weight", (shape.vocab_size, h), 1.0), "input_ids"], "embeddings", axis=0)
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}"
        normed = g.rms_norm(x, f"{p}.input_layernorm", h, shape.rms_eps)
        q = g.node("MatMul", [normed, g.weight(f"{p}.attn.q_proj.weight", (h, h), std)], f"{p}.q")
        k = g.node("MatMul", [normed, g.weight(f"{p}.attn.k_proj.weight", (h, kv * d), std)], f"{p}.k")
        v = g.node("MatMul", [normed, g.weight(f"{p}.attn.v_proj.weight", (h, kv * d), std)], f"{p}.v")
        attn = group_query_attention(g, shape, layout, layer, q, k, v, rope, shape.window(layer))
        o = g.node("MatMul", [attn, g.weight(f"{p}.attn.o_proj.weight", (h, h), std)], f"{p}.o")
        x = g.node("Add", [x, o], f"{p}.attn_residual")
        normed = g.rms_norm(x, f"{p}.post_attention_layernorm", h, shape.rms_eps)
        x = g.node("Add", [x, g.gated_mlp(normed, f"{p}.mlp", h, shape.intermediate_size, std)], f"{p}.mlp_residual")
    normed = g.rms_norm(x, "model.norm", h, shape.rms_eps)
    if tied_head:
        head = g.node("Transpose", ["model.embed_tokens.weight"], "lm_head.weight", perm=[1, 0])
    else:
        # RMSNorm output has unit scale, so a head with std logit_std/sqrt(h) gives logits of std logit_std.
        head = g.weight("lm_head.weight", (h, shape.vocab_size), shape.logit_std / np.sqrt(h))
    g.node("MatMul", [normed, head], "logits")
    if weights:
        raise ValueError(f"weights the graph has no place for: {sorted(weights)[:5]}")
    return g.model("kvshare_decoder", inputs, outputs)
