"""Reads a Llama-architecture GGUF file (llama.cpp's format) into what the folder writer needs: the
decoder's shape, float32 weights under the builder's names and in its orientation (``[in, out]``
for matmuls), the vocabulary and merges, the special token ids and the chat template.

Anything the ONNX graph cannot represent is refused with a ``GGUFError`` naming it, never
approximated: another architecture, rope scaling, attention biases, a tokenizer other than
byte-level BPE with a known pre-tokenizer, a rotary dimension other than the head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.modelbuild.presets import DecoderShape

# llama.cpp's pre-tokenizers, as the regular expressions it applies in order (llama-vocab.cpp).
# Only the ones whose byte-level BPE split the tokenizer writer can reproduce are listed.
PRE_TOKENIZERS = {
    "smollm": ("digits", "gpt2"),
    "gpt2": ("gpt2",),
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "attn.q_proj.weight",
    "attn_k": "attn.k_proj.weight",
    "attn_v": "attn.v_proj.weight",
    "attn_output": "attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
_REFUSED_KEYS = ("rope.scaling.type", "rope.scaling.factor", "attention.key_length", "attention.value_length",
                 "expert_count", "attention.clamp_kqv", "logit_scale")


class GGUFError(ValueError):
    """The file is not a model the converter can represent; the message names what."""


@dataclass(slots=True)
class GGUFModel:
    name: str
    shape: DecoderShape
    weights: dict[str, np.ndarray]
    """float32, builder names (``model.layers.0.attn.q_proj.weight``), matmul weights ``[in, out]``."""
    tied_head: bool
    """No ``output.weight``: the output head is the token embedding, transposed."""
    tokens: list[str]
    token_types: list[int]
    """llama.cpp's token types: 1 normal, 3 control, 4 user-defined, 6 byte."""
    merges: list[str]
    pre_tokenizer: str
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    chat_template: str | None


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of Q and K rows (``[out, in]``) for its interleaved rotary:
    back to the half-split layout that GroupQueryAttention's ``rotary_interleaved=0`` expects."""
    out, width = weight.shape
    return weight.reshape(heads, out // heads // 2, 2, width).swapaxes(1, 2).reshape(out, width)


def read_gguf(path: Path) -> GGUFModel:
    """The model in ``path``; GGUFError (never another exception) for anything unreadable or refused."""
    try:
        return _read(path)
    except GGUFError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError, OverflowError, OSError) as exc:
        raise GGUFError(f"not a readable Llama GGUF ({type(exc).__name__}: {exc})") from exc


def _read(path: Path) -> GGUFModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)

    def field(key: str, default: object = None) -> object:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise GGUFError(f"architecture {arch!r}: only 'llama' can be converted")
    for key in _REFUSED_KEYS:
        if f"{arch}.{key}" in reader.fields:
            raise GGUFError(f"{arch}.{key} is set: the graph has no way to represent it")
    heads, kv_heads = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    tokens = list(field("tokenizer.ggml.tokens"))
    shape = DecoderShape(
        num_layers=int(field("llama.block_count")), hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=int(field("llama.feed_forward_length")), vocab_size=len(tokens),
        context_length=int(field("llama.context_length")), rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
    )
    rotary = int(field("llama.rope.dimension_count", shape.head_size))
    if rotary != shape.head_size:
        raise GGUFError(f"rotary dimension {rotary} is not the head size {shape.head_size}")
    if field("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"tokenizer model {field('tokenizer.ggml.model')!r}: only byte-level BPE ('gpt2') is converted")
    pre = str(field("tokenizer.ggml.pre", "gpt2"))
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"pre-tokenizer {pre!r} is not one of {sorted(PRE_TOKENIZERS)}")

    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = tensor.name
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = values
        elif name == "output.weight":
            weights["lm_head.weight"] = values.T.copy()
        elif name == "output_norm.weight":
            weights["model.norm.weight"] = values
        elif name.startswith("blk.") and name.endswith(".weight"):
            _, layer, kind, _ = name.split(".")
            if kind not in _LAYER_TENSORS:
                raise GGUFError(f"tensor {name}: {kind} has no place in a Llama decoder layer")
            if values.ndim == 2:
                if kind in ("attn_q", "attn_k"):
                    values = _unpermute(values, heads if kind == "attn_q" else kv_heads)
                values = values.T.copy()
            weights[f"model.layers.{layer}.{_LAYER_TENSORS[kind]}"] = values
        else:
            raise GGUFError(f"tensor {name} (e.g. an attention bias) has no place in the graph")
    template = field("tokenizer.chat_template")
    return GGUFModel(
        name=str(field("general.name", path.stem)), shape=shape, weights=weights,
        tied_head="lm_head.weight" not in weights, tokens=tokens,
        token_types=[int(t) for t in field("tokenizer.ggml.token_type")], merges=list(field("tokenizer.ggml.merges")),
        pre_tokenizer=pre, bos_token_id=int(field("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(field("tokenizer.ggml.eos_token_id")),
        pad_token_id=int(field("tokenizer.ggml.padding_token_id", field("tokenizer.ggml.eos_token_id"))),
        chat_template=str(template) if template is not None else None,
    )
