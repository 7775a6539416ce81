"""Builds the two ONNX graphs of a seeded T5-like encoder-decoder, in ONNX Runtime GenAI's Whisper
naming so that one engine path serves both.

encoder.onnx: ``input_ids`` int64 ``[batch, encoder_sequence]`` -> ``present_key_cross_N`` /
``present_value_cross_N`` ``[batch, heads, encoder_sequence, head]`` for every decoder layer (the
cross-attention K/V, computed once per encoder input).

decoder.onnx: ``input_ids`` int64 ``[batch, sequence]``, ``past_key_self_N`` / ``past_value_self_N``
``[batch, heads, past_sequence, head]``, ``past_key_cross_N`` / ``past_value_cross_N`` -> ``logits``
and ``present_key_self_N`` / ``present_value_self_N``. Positions come from the past's length.
Attention is built from standard ops (the decoder's present is past concatenated with the new K/V).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from services.modelbuild.graph_writer import GraphWriter
from services.modelbuild.presets import EncoderDecoderShape

CROSS_KEY, CROSS_VALUE = "present_key_cross_%d", "present_value_cross_%d"
PAST_CROSS_KEY, PAST_CROSS_VALUE = "past_key_cross_%d", "past_value_cross_%d"
PAST_SELF_KEY, PAST_SELF_VALUE = "past_key_self_%d", "past_value_self_%d"
PRESENT_SELF_KEY, PRESENT_SELF_VALUE = "present_key_self_%d", "present_value_self_%d"


def _heads(g: GraphWriter, x: str, name: str) -> str:
    """[b, s, heads*head] -> [b, heads, s, head]."""
    split = g.node("Reshape", [x, "heads_shape"], f"{name}_split")
    return g.node("Transpose", [split], f"{name}_heads", perm=[0, 2, 1, 3])


def _attend(g: GraphWriter, q: str, k: str, v: str, name: str, scale: float, mask: str | None = None) -> str:
    """softmax(q k^T * scale + mask) v with q, k, v ``[b, heads, s, head]``; returns ``[b, s, hidden]``."""
    scores = g.node("MatMul", [q, g.node("Transpose", [k], f"{name}_kT", perm=[0, 1, 3, 2])], f"{name}_scores")
    scores = g.node("Mul", [scores, g.const(f"{name}_scale", np.array(scale, np.float32))], f"{name}_scaled")
    if mask is not None:
        scores = g.node("Add", [scores, mask], f"{name}_masked")
    probs = g.node("Softmax", [scores], f"{name}_probs", axis=-1)
    out = g.node("Transpose", [g.node("MatMul", [probs, v], f"{name}_ctx")], f"{name}_ctx_t", perm=[0, 2, 1, 3])
    return g.node("Reshape", [out, "merge_shape"], f"{name}_merged")


def _common_consts(g: GraphWriter, shape: EncoderDecoderShape) -> None:
    g.const("heads_shape", np.array([0, 0, shape.num_heads, shape.head_size], np.int64))
    g.const("merge_shape", np.array([0, 0, shape.hidden_size], np.int64))
    g.const("zero_i64", np.array(0, np.int64))
    g.const("one_i64", np.array(1, np.int64))


def build_encoder_graph(shape: EncoderDecoderShape, g: GraphWriter) -> onnx.ModelProto:
    h, std, scale = shape.hidden_size, shape.init_std, shape.head_size ** -0.5
    _common_consts(g, shape)
    embed = g.weight("encoder.embed_tokens.weight", (shape.vocab_size, h), 1.0)
    positions = g.weight("encoder.embed_positions.weight", (shape.encoder_context_length, h), 0.5)
    length = g.node("Gather", [g.node("Shape", ["input_ids"], "enc_ids_shape"), "one_i64"], "enc_len", axis=0)
    pos_ids = g.node("Range", ["zero_i64", length, "one_i64"], "enc_pos_ids")
    x = g.node("Add", [g.node("Gather", [embed, "input_ids"], "enc_tok", axis=0),
                       g.node("Gather", [positions, pos_ids], "enc_pos", axis=0)], "enc_embeddings")
    for layer in range(shape.encoder_layers):
        p = f"encoder.layers.{layer}"
        normed = g.rms_norm(x, f"{p}.input_layernorm", h, shape.rms_eps)
        q, k, v = (_heads(g, g.node("MatMul", [normed, g.weight(f"{p}.attn.{t}_proj.weight", (h, h), std)], f"{p}.{t}"), f"{p}.{t}")
                   for t in "qkv")
        attn = _attend(g, q, k, v, f"{p}.attn", scale)
        x = g.node("Add", [x, g.node("MatMul", [attn, g.weight(f"{p}.attn.o_proj.weight", (h, h), std)], f"{p}.o")], f"{p}.attn_residual")
        normed = g.rms_norm(x, f"{p}.post_attention_layernorm", h, shape.rms_eps)
        x = g.node("Add", [x, g.swiglu(normed, f"{p}.mlp", h, shape.intermediate_size, std)], f"{p}.mlp_residual")
    hidden = g.rms_norm(x, "encoder.norm", h, shape.rms_eps)
    cross_dims = ["batch_size", shape.num_heads, "encoder_sequence_length", shape.head_size]
    outputs = []
    for layer in range(shape.decoder_layers):
        p = f"decoder.layers.{layer}.cross_attn"
        for t, template in (("k", CROSS_KEY), ("v", CROSS_VALUE)):
            projected = g.node("MatMul", [hidden, g.weight(f"{p}.{t}_proj.weight", (h, h), std)], f"{p}.{t}")
            split = g.node("Reshape", [projected, "heads_shape"], f"{p}.{t}_split")
            g.node("Transpose", [split], template % layer, perm=[0, 2, 1, 3])
            outputs.append(helper.make_tensor_value_info(template % layer, TensorProto.FLOAT, cross_dims))
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "encoder_sequence_length"])]
    return g.model("kvshare_encoder", inputs, outputs)


def build_decoder_graph(shape: EncoderDecoderShape, g: GraphWriter) -> onnx.ModelProto:
    h, std, scale = shape.hidden_size, shape.init_std, shape.head_size ** -0.5
    _common_consts(g, shape)
    self_dims = ["batch_size", shape.num_heads, "past_sequence_length", shape.head_size]
    present_dims = ["batch_size", shape.num_heads, "total_sequence_length", shape.head_size]
    cross_dims = ["batch_size", shape.num_heads, "encoder_sequence_length", shape.head_size]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", shape.vocab_size])]
    for layer in range(shape.decoder_layers):
        inputs += [helper.make_tensor_value_info(t % layer, TensorProto.FLOAT, self_dims) for t in (PAST_SELF_KEY, PAST_SELF_VALUE)]
        inputs += [helper.make_tensor_value_info(t % layer, TensorProto.FLOAT, cross_dims) for t in (PAST_CROSS_KEY, PAST_CROSS_VALUE)]
        outputs += [helper.make_tensor_value_info(t % layer, TensorProto.FLOAT, present_dims)
                    for t in (PRESENT_SELF_KEY, PRESENT_SELF_VALUE)]

    # Positions past..past+s-1, and a causal mask letting query i see keys 0..past+i.
    g.const("axis_0", np.array([0], np.int64))
    g.const("axis_1", np.array([1], np.int64))
    past_len = g.node("Gather", [g.node("Shape", [PAST_SELF_KEY % 0], "past_shape"), g.const("axis_2", np.array(2, np.int64))],
                      "past_len", axis=0)
    new_len = g.node("Gather", [g.node("Shape", ["input_ids"], "ids_shape"), "one_i64"], "new_len", axis=0)
    total = g.node("Add", [past_len, new_len], "total_len")
    pos_ids = g.node("Range", [past_len, total, "one_i64"], "pos_ids")
    key_pos = g.node("Unsqueeze", [g.node("Range", ["zero_i64", total, "one_i64"], "key_pos_1d"), "axis_0"], "key_pos")
    query_pos = g.node("Unsqueeze", [pos_ids, "axis_1"], "query_pos")
    visible = g.node("LessOrEqual", [key_pos, query_pos], "visible")
    mask = g.node("Where", [visible, g.const("mask_open", np.array(0.0, np.float32)),
                            g.const("mask_closed", np.array(-1e9, np.float32))], "causal_mask")

    embed = g.weight("decoder.embed_tokens.weight", (shape.vocab_size, h), 1.0)
    positions = g.weight("decoder.embed_positions.weight", (shape.context_length, h), 0.5)
    x = g.node("Add", [g.node("Gather", [embed, "input_ids"], "dec_tok", axis=0),
                       g.node("Gather", [positions, pos_ids], "dec_pos", axis=0)], "dec_embeddings")
    for layer in range(shape.decoder_layers):
        p = f"decoder.layers.{layer}"
        normed = g.rms_norm(x, f"{p}.input_layernorm", h, shape.rms_eps)
        q, k, v = (_heads(g, g.node("MatMul", [normed, g.weight(f"{p}.self_attn.{t}_proj.weight", (h, h), std)], f"{p}.{t}"), f"{p}.{t}")
                   for t in "qkv")
        present_k = g.node("Concat", [PAST_SELF_KEY % layer, k], PRESENT_SELF_KEY % layer, axis=2)
        present_v = g.node("Concat", [PAST_SELF_VALUE % layer, v], PRESENT_SELF_VALUE % layer, axis=2)
        attn = _attend(g, q, present_k, present_v, f"{p}.self_attn", scale, mask)
        x = g.node("Add", [x, g.node("MatMul", [attn, g.weight(f"{p}.self_attn.o_proj.weight", (h, h), std)], f"{p}.self_o")],
                   f"{p}.self_residual")
        normed = g.rms_norm(x, f"{p}.cross_layernorm", h, shape.rms_eps)
        cq = _heads(g, g.node("MatMul", [normed, g.weight(f"{p}.cross_attn.q_proj.weight", (h, h), std)], f"{p}.cq"), f"{p}.cq")
        cross = _attend(g, cq, PAST_CROSS_KEY % layer, PAST_CROSS_VALUE % layer, f"{p}.cross_attn", scale)
        x = g.node("Add", [x, g.node("MatMul", [cross, g.weight(f"{p}.cross_attn.o_proj.weight", (h, h), std)], f"{p}.cross_o")],
                   f"{p}.cross_residual")
        normed = g.rms_norm(x, f"{p}.post_attention_layernorm", h, shape.rms_eps)
        x = g.node("Add", [x, g.swiglu(normed, f"{p}.mlp", h, shape.intermediate_size, std)], f"{p}.mlp_residual")
    normed = g.rms_norm(x, "decoder.norm", h, shape.rms_eps)
    # RMSNorm output has unit scale, so a head with std logit_std/sqrt(h) gives logits of std logit_std.
    g.node("MatMul", [normed, g.weight("lm_head.weight", (h, shape.vocab_size), shape.logit_std / np.sqrt(h))], "logits")
    return g.model("kvshare_decoder", inputs, outputs)


def build_encoder_decoder(shape: EncoderDecoderShape, seed: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(encoder, decoder) with seeded weights; the same arguments give the same bytes."""
    return build_encoder_graph(shape, GraphWriter(seed)), build_decoder_graph(shape, GraphWriter(seed + 1))
