"""What each GGUF architecture the converter takes means: the decoder shape its keys describe and
where each of its tensors goes in the builder's names, as llama.cpp reads them (src/models/*.cpp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.modelbuild.gguf_blocks import QuantBlocks
from services.modelbuild.gguf_fields import Fields, GGUFError
from services.modelbuild.presets import DecoderShape

GEMMA3_SWA_PATTERN = 6
"""llama.cpp's gemma3 default when the file has no ``sliding_window_pattern``: of every 6 layers
the first 5 attend within the window (``il % 6 < 5``)."""
GEMMA3_ROPE_BASE_SWA = 10000.0
"""llama.cpp's ``rope_freq_base_train_swa`` when the file has no ``rope.freq_base_swa``."""


@dataclass(frozen=True, slots=True)
class Architecture:
    layer_tensors: dict[str, str]
    """GGUF ``blk.N.<kind>.weight`` kind -> builder name under ``model.layers.N.``."""
    shape: Callable[[Fields, int], DecoderShape]
    """(the file's fields, vocabulary size) -> the decoder's shape."""
    refused_keys: tuple[str, ...]
    """Keys (after ``{arch}.``) whose presence alone means the graph cannot represent the model."""
    permuted_qk: bool
    """llama.cpp's converter reorders Q and K rows for an interleaved rotary (Llama, not Gemma)."""
    untied_head: bool
    """Whether an ``output.weight`` (an untied head) has a place in the graph."""
    genai_type: str
    """genai_config.json's ``model.type``, as ONNX Runtime GenAI's builder writes it for the
    architecture (Gemma 3 text-only: ``gemma3_text``; its ``gemma3`` is the vision-language pipeline)."""

    def _place(self, name: str) -> tuple[str, str | None]:
        """GGUF tensor ``name``'s builder name and its layer kind (None outside the layers)."""
        if name == "token_embd.weight":
            return "model.embed_tokens.weight", None
        if name == "output_norm.weight":
            return "model.norm.weight", None
        if name == "output.weight" and self.untied_head:
            return "lm_head.weight", None
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in self.layer_tensors:
            raise GGUFError(f"tensor {name} (e.g. a bias or an untied head) has no place in the graph")
        _, layer, kind, _ = parts
        return f"model.layers.{layer}.{self.layer_tensors[kind]}", kind

    def _row_order(self, kind: str | None, rows: int, shape: DecoderShape) -> np.ndarray | None:
        """The order of a 2-D weight's output rows in the graph (None: as stored)."""
        if self.permuted_qk and kind in ("attn_q", "attn_k"):
            heads = shape.num_heads if kind == "attn_q" else shape.num_kv_heads
            return _unpermute(np.arange(rows)[:, None], heads)[:, 0]
        return None

    def tensor(self, name: str, values: np.ndarray, shape: DecoderShape) -> tuple[str, np.ndarray]:
        """The builder's name and orientation of GGUF tensor ``name`` (float32 ``values``):
        matmul weights ``[in, out]``, the embedding ``[vocab, hidden]``."""
        builder, kind = self._place(name)
        if kind is None:
            return builder, values.T.copy() if builder == "lm_head.weight" else values
        if values.ndim == 2:
            order = self._row_order(kind, values.shape[0], shape)
            values = (values if order is None else values[order]).T.copy()
        return builder, values

    def blocks(self, name: str, blocks: QuantBlocks, shape: DecoderShape) -> tuple[str, QuantBlocks]:
        """The builder's name of GGUF tensor ``name`` and its ``blocks`` with rows in the graph's
        order (MatMulNBits keeps ``[out, in]``, as the file does)."""
        builder, kind = self._place(name)
        order = self._row_order(kind, blocks.shape[0], shape)
        return builder, blocks if order is None else blocks.rows(order)


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of Q and K rows (``[out, in]``) for its interleaved rotary:
    back to the half-split layout that GroupQueryAttention's ``rotary_interleaved=0`` expects."""
    out, width = weight.shape
    return weight.reshape(heads, out // heads // 2, 2, width).swapaxes(1, 2).reshape(out, width)


_PROJECTIONS = {
    "attn_q": "attn.q_proj.weight",
    "attn_k": "attn.k_proj.weight",
    "attn_v": "attn.v_proj.weight",
    "attn_output": "attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
_SCALED_ROPE = ("rope.scaling.type", "rope.scaling.factor")


def _common(f: Fields, vocab: int) -> dict:
    return dict(
        num_layers=int(f.required("block_count")), hidden_size=int(f.required("embedding_length")),
        num_heads=int(f.required("attention.head_count")), num_kv_heads=int(f.required("attention.head_count_kv")),
        intermediate_size=int(f.required("feed_forward_length")), vocab_size=vocab,
        context_length=int(f.required("context_length")), rope_theta=float(f.arch_get("rope.freq_base", 10000.0)),
        rms_eps=float(f.required("attention.layer_norm_rms_epsilon")),
    )


def _llama_shape(f: Fields, vocab: int) -> DecoderShape:
    return DecoderShape(**_common(f, vocab))


def _windowed_layers(f: Fields, layers: int) -> tuple[int, ...]:
    """llama.cpp's ``load_swa_pattern``: a per-layer array, else every ``n``-th layer global."""
    pattern = f.arch_get("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return tuple(i for i, windowed in enumerate(pattern) if windowed)
    n = int(pattern)
    return tuple(i for i in range(layers) if n == 0 or i % n < n - 1)


def _gemma3_shape(f: Fields, vocab: int) -> DecoderShape:
    common = _common(f, vocab)
    heads, hidden = common["num_heads"], common["hidden_size"]
    head = int(f.arch_get("attention.key_length", hidden // heads))
    if int(f.arch_get("attention.value_length", head)) != head:
        raise GGUFError("attention.value_length differs from attention.key_length: GroupQueryAttention needs one head size")
    if float(f.arch_get("final_logit_softcapping", 0.0)):
        raise GGUFError(f"{f.arch}.final_logit_softcapping is set: the graph has no softcapping")
    if common["num_layers"] == 62 and hidden // heads != head:
        # llama.cpp scales a 27B's queries by 1/sqrt(hidden / heads); GroupQueryAttention's default is 1/sqrt(head).
        raise GGUFError("a 62-layer Gemma 3 (27B) scales its queries by 1/sqrt(hidden / heads): not represented")
    window = int(f.arch_get("attention.sliding_window", 0))
    windowed = _windowed_layers(f, common["num_layers"]) if window > 0 else ()
    return DecoderShape(
        **common, head_dim=head, qk_norm=True, post_norms=True, activation="gelu_tanh",
        embedding_scale=float(np.float32(np.sqrt(np.float32(hidden)))),
        rope_theta_windowed=float(f.arch_get("rope.freq_base_swa", GEMMA3_ROPE_BASE_SWA)) if windowed else None,
        sliding_window=window if windowed else 0, windowed_layers=windowed,
    )


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        layer_tensors={"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
                       **_PROJECTIONS},
        shape=_llama_shape,
        refused_keys=(*_SCALED_ROPE, "attention.key_length", "attention.value_length", "expert_count",
                      "attention.clamp_kqv", "logit_scale", "attention.sliding_window"),
        permuted_qk=True, untied_head=True, genai_type="llama",
    ),
    # src/models/gemma3.cpp: norm weights are used as RMSNorm multipliers as stored (the converter
    # wrote Gemma's 1 + w); ffn_norm is the norm before the MLP, the post norms come after.
    "gemma3": Architecture(
        layer_tensors={"attn_norm": "input_layernorm.weight", "attn_q_norm": "attn.q_norm.weight",
                       "attn_k_norm": "attn.k_norm.weight", "post_attention_norm": "post_attention_layernorm.weight",
                       "ffn_norm": "pre_feedforward_layernorm.weight",
                       "post_ffw_norm": "post_feedforward_layernorm.weight", **_PROJECTIONS},
        shape=_gemma3_shape,
        refused_keys=(*_SCALED_ROPE, "expert_count", "attention.clamp_kqv", "logit_scale", "attn_logit_softcapping"),
        permuted_qk=False, untied_head=False, genai_type="gemma3_text",
    ),
}
