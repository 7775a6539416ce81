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


def split_heads(g: GraphWriter, x: str, name: str) -> str:
    """[b, s, heads*head] -> [b, heads, s, head]."""
    split = g.node("Reshape", [x, "heads_shape"], f"{name}_split")
    return g.node("Transpose", [split], f"{name}_heads", perm=[0, 2, 1, 3])


def attend(g: GraphWriter, q: str, k: str, v: str, name: str, scale: float, mask: str | None = None) -> str:
    """softmax(q k^T * scale + mask) v with q, k, v ``[b, heads, s, head]``; returns ``[b, s, hidden]``."""
    scores = g.node("MatMul", [q, g.node("Transpose", [k], f"{name}_kT", perm=[0, 1, 3, 2])], f"{name}_scores")
    scores = g.node("Mul", [scores, g.const(f"{name}_scale", np.array(scale, np.float32))], f"{name}_scaled")
    if mask is not None:
        scores = g.node("Add", [scores, mask], f"{name}_masked")
    probs = g.node("Softmax", [scores], f"{name}_probs", axis=-1)
    out = g.node("Transpose", [g.node("MatMul", [probs, v], f"{name}_ctx")], f"{name}_ctx_t", perm=[0, 2, 1, 3])
    return g.node("Reshape", [out, "merge_shape"], f"{name}_merged")


def _project_heads(g: GraphWriter, x: str, weight: str, name: str, width: int, std: float) -> str:
    """``x @ weight`` split into heads: ``[b, heads, s, head]``."""
    return split_heads(g, g.node("MatMul", [x, g.weight(weight, (width, width), std)], name), name)


def _add_projected(g: GraphWriter, x: str, attn: str, weight: str, name: str, width: int, std: float) -> str:
    """The residual stream ``x`` plus ``attn @ weight`` (an attention block's output projection)."""
    return g.node("Add", [x, g.node("MatMul", [attn, g.weight(weight, (width, width), std)], f"{name}_o")], f"{name}_residual")


def _embed(g: GraphWriter, prefix: str, shape: EncoderDecoderShape, positions_count: int, pos_ids: str) -> str:
    """Token embeddings of ``input_ids`` plus learned position embeddings at ``pos_ids``."""
    h = shape.hidden_size
    embed = g.weight(f"{prefix}.embed_tokens.weight", (shape.vocab_size, h), 1.0)
    positions = g.weight(f"{prefix}.embed_positions.weight", (positions_count, h), 0.5)
    return g.node("Add", [g.node("Gather", [embed, "input_ids"], f"{prefix}_tok", axis=0),
                          g.node("Gather", [positions, pos_ids], f"{prefix}_pos", axis=0)], f"{prefix}_embeddings")


def _mlp_block(g: GraphWriter, x: str, prefix: str, shape: EncoderDecoderShape) -> str:
    normed = g.rms_norm(x, f"{prefix}.post_attention_layernorm", shape.hidden_size, shape.rms_eps)
    mlp = g.gated_mlp(normed, f"{prefix}.mlp", shape.hidden_size, shape.intermediate_size, shape.init_std)
    return g.node("Add", [x, mlp], f"{prefix}.mlp_residual")


def common_consts(g: GraphWriter, heads: int, head_size: int) -> None:
    """The reshape targets ``split_heads`` and ``attend`` use."""
    g.const("heads_shape", np.array([0, 0, heads, head_size], np.int64))
    g.const("merge_shape", np.array([0, 0, heads * head_size], np.int64))


def _scalars(g: GraphWriter) -> None:
    g.const("zero_i64", np.array(0, np.int64))
    g.const("one_i64", np.array(1, np.int64))


def causal_positions(g: GraphWriter, past_key: str) -> tuple[str, str]:
    """(positions past..past+s-1 ``[s]``, a causal mask ``[s, past+s]`` letting query i see keys
    0..past+i), the past's length read from ``past_key`` ``[b, heads, past, head]``."""
    _scalars(g)
    g.const("axis_0", np.array([0], np.int64))
    g.const("axis_1", np.array([1], np.int64))
    past_len = g.node("Gather", [g.node("Shape", [past_key], "past_shape"), g.const("axis_2", np.array(2, np.int64))],
                      "past_len", axis=0)
    new_len = g.node("Gather", [g.node("Shape", ["input_ids"], "ids_shape"), "one_i64"], "new_len", axis=0)
    total = g.node("Add", [past_len, new_len], "total_len")
    pos_ids = g.node("Range", [past_len, total, "one_i64"], "pos_ids")
    key_pos = g.node("Unsqueeze", [g.node("Range", ["zero_i64", total, "one_i64"], "key_pos_1d"), "axis_0"], "key_pos")
    query_pos = g.node("Unsqueeze", [pos_ids, "axis_1"], "query_pos")
    visible = g.node("LessOrEqual", [key_pos, query_pos], "visible")
    mask = g.node("Where", [visible, g.const("mask_open", np.array(0.0, np.float32)),
                            g.const("mask_closed", np.array(-1e9, np.float32))], "causal_mask")
    return pos_ids, mask


def build_encoder_graph(shape: EncoderDecoderShape, g: GraphWriter) -> onnx.ModelProto:
    h, std, scale = shape.hidden_size, shape.init_std, shape.head_size ** -0.5
    common_consts(g, shape.num_heads, shape.head_size)
    _scalars(g)
    length = g.node("Gather", [g.node("Shape", ["input_ids"], "enc_ids_shape"), "one_i64"], "enc_len", axis=0)
    pos_ids = g.node("Range", ["zero_i64", length, "one_i64"], "enc_pos_ids")
    x = _embed(g, "encoder", shape, shape.encoder_context_length, pos_ids)
    for layer in range(shape.encoder_layers):
        p = f"encoder.layers.{layer}"
        normed = g.rms_norm(x, f"{p}.input_layernorm", h, shape.rms_eps)
        q, k, v = (_project_heads(g, normed, f"{p}.attn.{t}_proj.weight", f"{p}.{t}", h, std) for t in "qkv")
        attn = attend(g, q, k, v, f"{p}.attn", scale)
        x = _mlp_block(g, _add_projected(g, x, attn, f"{p}.attn.o_proj.weight", f"{p}.attn", h, std), p, shape)
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


def decoder_io(heads: int, head_size: int, layers: int, vocab_size: int, ids_type: int) -> tuple[list, list]:
    """The decoder's graph inputs (``input_ids`` of ``ids_type``, each layer's self past and cross
    K/V) and outputs (logits, each layer's self present), in GenAI's Whisper names."""
    self_dims = ["batch_size", heads, "past_sequence_length", head_size]
    present_dims = ["batch_size", heads, "total_sequence_length", head_size]
    cross_dims = ["batch_size", heads, "encoder_sequence_length", head_size]
    inputs = [helper.make_tensor_value_info("input_ids", ids_type, ["batch_size", "sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab_size])]
    for layer in range(layers):
        inputs += [helper.make_tensor_value_info(t % layer, TensorProto.FLOAT, self_dims) for t in (PAST_SELF_KEY, PAST_SELF_VALUE)]
        inputs += [helper.make_tensor_value_info(t % layer, TensorProto.FLOAT, cross_dims) for t in (PAST_CROSS_KEY, PAST_CROSS_VALUE)]
        outputs += [helper.make_tensor_value_info(t % layer, TensorProto.FLOAT, present_dims)
                    for t in (PRESENT_SELF_KEY, PRESENT_SELF_VALUE)]
    return inputs, outputs


def build_decoder_graph(shape: EncoderDecoderShape, g: GraphWriter) -> onnx.ModelProto:
    h, std, scale = shape.hidden_size, shape.init_std, shape.head_size ** -0.5
    common_consts(g, shape.num_heads, shape.head_size)
    inputs, outputs = decoder_io(shape.num_heads, shape.head_size, shape.decoder_layers, shape.vocab_size, TensorProto.INT64)

    pos_ids, mask = causal_positions(g, PAST_SELF_KEY % 0)
    x = _embed(g, "decoder", shape, shape.context_length, pos_ids)
    for layer in range(shape.decoder_layers):
        p = f"decoder.layers.{layer}"
        normed = g.rms_norm(x, f"{p}.input_layernorm", h, shape.rms_eps)
        q, k, v = (_project_heads(g, normed, f"{p}.self_attn.{t}_proj.weight", f"{p}.{t}", h, std) for t in "qkv")
        present_k = g.node("Concat", [PAST_SELF_KEY % layer, k], PRESENT_SELF_KEY % layer, axis=2)
        present_v = g.node("Concat", [PAST_SELF_VALUE % layer, v], PRESENT_SELF_VALUE % layer, axis=2)
        attn = attend(g, q, present_k, present_v, f"{p}.self_attn", scale, mask)
        x = _add_projected(g, x, attn, f"{p}.self_attn.o_proj.weight", f"{p}.self_attn", h, std)
        normed = g.rms_norm(x, f"{p}.cross_layernorm", h, shape.rms_eps)
        cq = _project_heads(g, normed, f"{p}.cross_attn.q_proj.weight", f"{p}.cq", h, std)
        cross = attend(g, cq, PAST_CROSS_KEY % layer, PAST_CROSS_VALUE % layer, f"{p}.cross_attn", scale)
        x = _mlp_block(g, _add_projected(g, x, cross, f"{p}.cross_attn.o_proj.weight", f"{p}.cross_attn", h, std), p, shape)
    normed = g.rms_norm(x, "decoder.norm", h, shape.rms_eps)
    # RMSNorm output has unit scale, so a head with std logit_std/sqrt(h) gives logits of std logit_std.
    g.node("MatMul", [normed, g.weight("lm_head.weight", (h, shape.vocab_size), shape.logit_std / np.sqrt(h))], "logits")
    return g.model("kvshare_decoder", inputs, outputs)


def build_encoder_decoder(shape: EncoderDecoderShape, seed: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(encoder, decoder) with seeded weights; the same arguments give the same bytes."""
    return build_encoder_graph(shape, GraphWriter(seed)), build_decoder_graph(shape, GraphWriter(seed + 1))
