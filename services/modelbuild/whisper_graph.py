"""Builds ONNX Runtime GenAI-layout Whisper graphs from a CTranslate2 ``WhisperSpec`` model.

encoder.onnx: ``audio_features`` float32 ``[batch, mels, 3000]`` (log-mel of one 30-s window; the
frames are fixed, as the positions they map to are) -> ``present_key_cross_N`` /
``present_value_cross_N`` ``[batch, heads, 1500, head]``
for every decoder layer: the cross-attention K/V, computed once per audio window.

decoder.onnx: ``input_ids`` int32 ``[batch, sequence]``, ``past_key_self_N`` / ``past_value_self_N``
``[batch, heads, past, head]`` and ``past_key_cross_N`` / ``past_value_cross_N`` -> ``logits``
float32 ``[batch, sequence, vocab]`` and ``present_key_self_N`` / ``present_value_self_N``.
Positions come from the past's length.

The architecture, from the weights' names (CTranslate2's whisper_spec.py and transformer_spec.py):
two 3-wide convolutions (stride 1 then 2, padding 1, exact GELU after each), stored sinusoidal
positions, pre-norm layers with LayerNorm (bias, eps 1e-5), a fused Q|K|V projection for
self-attention (K's bias is stored as zeros), cross-attention Q from ``linear_0`` and a fused K|V
``linear_1`` applied to the encoder's final LayerNorm output, a GELU feed-forward, learned decoder
positions, and logits from the token embedding (tied). Attention scales Q K^T by head_size^-0.5.
Weights are stored as float16 and widened to float32 here, as CTranslate2's float32 compute type does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from services.modelbuild.ctranslate2_model import (
    CTranslate2FormatError,
    CTranslate2Model,
)
from services.modelbuild.encdec_graph import (
    CROSS_KEY,
    CROSS_VALUE,
    PAST_CROSS_KEY,
    PAST_CROSS_VALUE,
    PAST_SELF_KEY,
    PAST_SELF_VALUE,
    PRESENT_SELF_KEY,
    PRESENT_SELF_VALUE,
    attend,
    causal_positions,
    common_consts,
    decoder_io,
    split_heads,
)
from services.modelbuild.graph_writer import MS_DOMAIN, GraphWriter

LAYER_NORM_EPS = 1e-5
AUDIO_INPUT = "audio_features"


@dataclass(frozen=True, slots=True)
class WhisperShape:
    """Read off the weights: nothing about the geometry is assumed."""

    mels: int
    hidden_size: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    audio_positions: int
    """Encoder positions (frames after the stride-2 convolution): 1500 for 30 s."""
    text_positions: int
    """Decoder context length in tokens (448)."""
    vocab_size: int

    @classmethod
    def of(cls, model: CTranslate2Model) -> WhisperShape:
        if model.spec != "WhisperSpec":
            raise CTranslate2FormatError(f"a {model.spec} model, not a WhisperSpec")
        v = model.variables

        def layers(prefix: str) -> int:
            return sum(1 for name in v if name.startswith(prefix) and name.endswith("/ffn/linear_0/weight"))

        hidden, mels, _ = model["encoder/conv1/weight"].shape
        return cls(mels=mels, hidden_size=hidden, encoder_layers=layers("encoder/layer_"),
                   decoder_layers=layers("decoder/layer_"), encoder_heads=int(model["encoder/num_heads"]),
                   decoder_heads=int(model["decoder/num_heads"]),
                   audio_positions=model["encoder/position_encodings/encodings"].shape[0],
                   text_positions=model["decoder/position_encodings/encodings"].shape[0],
                   vocab_size=model["decoder/embeddings/weight"].shape[0])


class _Weights:
    """The model's float arrays as float32 initializers, each added to the graph once."""

    def __init__(self, g: GraphWriter, model: CTranslate2Model) -> None:
        self.g, self.model = g, model

    def __call__(self, name: str, rows: slice = slice(None), transpose: bool = False) -> str:
        """Initializer for ``name`` (``rows`` of it), transposed for ``x @ W^T`` when asked."""
        suffix = "" if rows == slice(None) else f"[{rows.start}:{rows.stop}]"
        values = self.model[name][rows].astype(np.float32)
        return self.g.const(name + suffix + ("^T" if transpose else ""), np.ascontiguousarray(values.T if transpose else values))


def _linear(g: GraphWriter, w: _Weights, x: str, prefix: str, name: str, rows: slice = slice(None)) -> str:
    """``x @ W[rows]^T + b[rows]`` for CTranslate2's ``prefix/{weight,bias}`` (``[out, in]``)."""
    product = g.node("MatMul", [x, w(f"{prefix}/weight", rows, transpose=True)], f"{name}_mm")
    return g.node("Add", [product, w(f"{prefix}/bias", rows)], name)


def _layer_norm(g: GraphWriter, w: _Weights, x: str, prefix: str) -> str:
    return g.node("LayerNormalization", [x, w(f"{prefix}/gamma"), w(f"{prefix}/beta")], f"{prefix}_out",
                  axis=-1, epsilon=LAYER_NORM_EPS)


def _gelu(g: GraphWriter, x: str) -> str:
    """Exact (erf) GELU."""
    return g.node("Gelu", [x], f"{x}_gelu", domain=MS_DOMAIN)


def _fused_heads(g: GraphWriter, w: _Weights, x: str, prefix: str, parts: int, hidden: int) -> list[str]:
    """One ``parts x hidden``-wide projection, split into ``parts`` tensors ``[b, heads, s, head]``."""
    fused = _linear(g, w, x, prefix, f"{prefix}_fused")
    split = [f"{prefix}_part{i}" for i in range(parts)]
    sizes = g.const(f"{prefix}_sizes", np.full(parts, hidden, np.int64))
    g.nodes.append(helper.make_node("Split", [fused, sizes], split, name=f"{prefix}_split", axis=-1))
    return [split_heads(g, part, part) for part in split]


def _feed_forward(g: GraphWriter, w: _Weights, x: str, prefix: str) -> str:
    normed = _layer_norm(g, w, x, f"{prefix}/layer_norm")
    inner = _gelu(g, _linear(g, w, normed, f"{prefix}/linear_0", f"{prefix}_up"))
    return g.node("Add", [x, _linear(g, w, inner, f"{prefix}/linear_1", f"{prefix}_down")], f"{prefix}_residual")


def build_encoder(model: CTranslate2Model, shape: WhisperShape) -> onnx.ModelProto:
    """``shape``: ``WhisperShape.of(model)``."""
    if shape.decoder_heads != shape.encoder_heads:  # the cross K/V reuse the encoder's head split
        raise CTranslate2FormatError("encoder and decoder head counts differ; this converter expects them equal")
    g, h = GraphWriter(0), shape.hidden_size
    w = _Weights(g, model)
    heads, scale = shape.encoder_heads, (h // shape.encoder_heads) ** -0.5
    common_consts(g, heads, h // heads)
    x = AUDIO_INPUT
    for i, stride in ((1, 1), (2, 2)):
        conv = g.node("Conv", [x, w(f"encoder/conv{i}/weight"), w(f"encoder/conv{i}/bias")], f"encoder_conv{i}",
                      kernel_shape=[3], pads=[1, 1], strides=[stride])
        x = _gelu(g, conv)
    x = g.node("Transpose", [x], "encoder_frames", perm=[0, 2, 1])  # [b, frames, hidden]
    x = g.node("Add", [x, w("encoder/position_encodings/encodings")], "encoder_positioned")
    for layer in range(shape.encoder_layers):
        p = f"encoder/layer_{layer}"
        normed = _layer_norm(g, w, x, f"{p}/self_attention/layer_norm")
        q, k, v = _fused_heads(g, w, normed, f"{p}/self_attention/linear_0", 3, h)
        attn = attend(g, q, k, v, f"{p}_attn", scale)
        x = g.node("Add", [x, _linear(g, w, attn, f"{p}/self_attention/linear_1", f"{p}_attn_out")], f"{p}_attn_residual")
        x = _feed_forward(g, w, x, f"{p}/ffn")
    hidden = _layer_norm(g, w, x, "encoder/layer_norm")
    cross_dims = ["batch_size", shape.decoder_heads, "encoder_sequence_length", h // shape.decoder_heads]
    outputs = []
    for layer in range(shape.decoder_layers):
        prefix = f"decoder/layer_{layer}/attention/linear_1"
        for i, template in enumerate((CROSS_KEY, CROSS_VALUE)):
            projected = _linear(g, w, hidden, prefix, f"{prefix}_{i}", slice(i * h, (i + 1) * h))
            split = g.node("Reshape", [projected, "heads_shape"], f"{prefix}_{i}_split")
            g.node("Transpose", [split], template % layer, perm=[0, 2, 1, 3])
            outputs.append(helper.make_tensor_value_info(template % layer, TensorProto.FLOAT, cross_dims))
    # The frames are fixed (the positions are): features of another length are refused by the
    # input check, never run into a shape error inside ONNX Runtime.
    frames = 2 * shape.audio_positions
    inputs = [helper.make_tensor_value_info(AUDIO_INPUT, TensorProto.FLOAT, ["batch_size", shape.mels, frames])]
    return g.model("whisper_encoder", inputs, outputs)


def build_decoder(model: CTranslate2Model, shape: WhisperShape) -> onnx.ModelProto:
    """``shape``: ``WhisperShape.of(model)``."""
    g, h, heads = GraphWriter(0), shape.hidden_size, shape.decoder_heads
    w = _Weights(g, model)
    head, scale = h // heads, (h // heads) ** -0.5
    common_consts(g, heads, head)
    inputs, outputs = decoder_io(heads, head, shape.decoder_layers, shape.vocab_size, TensorProto.INT32)

    pos_ids, mask = causal_positions(g, PAST_SELF_KEY % 0)
    embedding = w("decoder/embeddings/weight")
    x = g.node("Add", [g.node("Gather", [embedding, "input_ids"], "decoder_tokens", axis=0),
                       g.node("Gather", [w("decoder/position_encodings/encodings"), pos_ids], "decoder_positions", axis=0)],
               "decoder_embedded")
    for layer in range(shape.decoder_layers):
        p = f"decoder/layer_{layer}"
        normed = _layer_norm(g, w, x, f"{p}/self_attention/layer_norm")
        q, k, v = _fused_heads(g, w, normed, f"{p}/self_attention/linear_0", 3, h)
        present_k = g.node("Concat", [PAST_SELF_KEY % layer, k], PRESENT_SELF_KEY % layer, axis=2)
        present_v = g.node("Concat", [PAST_SELF_VALUE % layer, v], PRESENT_SELF_VALUE % layer, axis=2)
        attn = attend(g, q, present_k, present_v, f"{p}_self", scale, mask)
        x = g.node("Add", [x, _linear(g, w, attn, f"{p}/self_attention/linear_1", f"{p}_self_out")], f"{p}_self_residual")
        normed = _layer_norm(g, w, x, f"{p}/attention/layer_norm")
        cq = split_heads(g, _linear(g, w, normed, f"{p}/attention/linear_0", f"{p}_cross_q"), f"{p}_cross_q")
        cross = attend(g, cq, PAST_CROSS_KEY % layer, PAST_CROSS_VALUE % layer, f"{p}_cross", scale)
        x = g.node("Add", [x, _linear(g, w, cross, f"{p}/attention/linear_2", f"{p}_cross_out")], f"{p}_cross_residual")
        x = _feed_forward(g, w, x, f"{p}/ffn")
    normed = _layer_norm(g, w, x, "decoder/layer_norm")
    # The head is the token embedding; transposed in the graph (folded once at load), not stored twice.
    g.node("MatMul", [normed, g.node("Transpose", [embedding], "decoder_head", perm=[1, 0])], "logits")
    return g.model("whisper_decoder", inputs, outputs)
