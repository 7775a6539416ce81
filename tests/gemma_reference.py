"""Gemma 3 as llama.cpp computes it (src/models/gemma3.cpp), in float64 numpy over a GGUF's own
tensor names and orientation (``[out, in]``): the reference the converted graph is checked
against, written from llama.cpp's code rather than from the converter's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
_WORDS = ["▁the", "▁a", "▁cat", "▁sat", "▁on", "▁mat", "▁dog", "▁ran", "▁far", "▁and", "▁then", "▁slept"]


@dataclass(frozen=True, slots=True)
class TinyGemma:
    """A small Gemma 3: 6 layers of which 0-4 are windowed (llama.cpp's default pattern of 6)."""

    layers: int = 6
    hidden: int = 24
    heads: int = 2
    kv_heads: int = 1
    head: int = 16
    """heads x head = 32, wider than ``hidden`` as in Gemma 3 270M (4 x 256 over 640)."""
    ffn: int = 48
    window: int = 8
    context: int = 128
    eps: float = 1e-6
    rope_base: float = 1e6
    rope_base_swa: float = 1e4

    @property
    def vocab(self) -> list[str]:
        return _SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + _WORDS

    def windowed(self, layer: int) -> bool:
        return layer % 6 < 5


def tiny_tensors(shape: TinyGemma, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 tensors under the GGUF names, as llama.cpp's converter writes them (norm
    weights already 1 + w)."""
    rng = np.random.default_rng(seed)
    h, q, kv, ff, v = shape.hidden, shape.heads * shape.head, shape.kv_heads * shape.head, shape.ffn, len(shape.vocab)

    def mat(out: int, width: int) -> np.ndarray:
        return (rng.standard_normal((out, width)) / np.sqrt(width)).astype(np.float32)

    def norm(width: int) -> np.ndarray:
        return (1.0 + 0.3 * rng.standard_normal(width)).astype(np.float32)

    tensors = {"token_embd.weight": (0.5 * rng.standard_normal((v, h))).astype(np.float32), "output_norm.weight": norm(h)}
    for i in range(shape.layers):
        tensors |= {
            f"blk.{i}.attn_norm.weight": norm(h), f"blk.{i}.attn_q.weight": mat(q, h),
            f"blk.{i}.attn_k.weight": mat(kv, h), f"blk.{i}.attn_v.weight": mat(kv, h),
            f"blk.{i}.attn_q_norm.weight": norm(shape.head), f"blk.{i}.attn_k_norm.weight": norm(shape.head),
            f"blk.{i}.attn_output.weight": mat(h, q), f"blk.{i}.post_attention_norm.weight": norm(h),
            f"blk.{i}.ffn_norm.weight": norm(h), f"blk.{i}.ffn_gate.weight": mat(ff, h),
            f"blk.{i}.ffn_up.weight": mat(ff, h), f"blk.{i}.ffn_down.weight": mat(h, ff),
            f"blk.{i}.post_ffw_norm.weight": norm(h),
        }
    return tensors


def write_tiny_gguf(path: Path, shape: TinyGemma, tensors: dict[str, np.ndarray],
                    extra: dict[str, float] | None = None, types: dict[str, str] | None = None) -> Path:
    """A ``gemma3`` GGUF with the keys llama.cpp's converter writes for Gemma 3 (no
    ``rope.freq_base_swa``, no ``sliding_window_pattern``: llama.cpp's defaults apply), and the
    float32 keys ``extra``. ``types``: tensor name -> GGUF block type (``Q4_1``) it is quantized
    to with gguf's own quantizer; the others stay float32."""
    from gguf import GGUFWriter, TokenType

    w = GGUFWriter(str(path), "gemma3")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_key_length(shape.head)
    w.add_value_length(shape.head)
    w.add_rope_freq_base(shape.rope_base)
    w.add_sliding_window(shape.window)
    w.add_tokenizer_model("llama")
    w.add_token_list(shape.vocab)
    w.add_token_scores([-1000.0] * 4 + [0.0] * 256 + [-float(i) for i in range(len(_WORDS))])
    w.add_token_types([TokenType.CONTROL] * 4 + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(_WORDS))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    for name, values in tensors.items():
        kind = (types or {}).get(name)
        if kind is None:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, quantize(values, GGMLQuantizationType[kind]), raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """NEOX rotary (llama.cpp's rope type 2): dimension i turns with i + head/2. ``x`` [seq, heads, head]."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * base ** (-np.arange(half) * 2.0 / x.shape[-1])
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def last_logits(shape: TinyGemma, tensors: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """The logits after the last of ``ids`` (float64): a full causal pass, windowed layers masking
    every key with ``p - p0 >= window``."""
    t = {name: values.astype(np.float64) for name, values in tensors.items()}
    n, d = len(ids), shape.head
    positions = np.arange(n, dtype=np.float64)
    distance = positions[:, None] - positions[None, :]
    x = t["token_embd.weight"][ids] * float(np.sqrt(np.float32(shape.hidden)))
    for i in range(shape.layers):
        w = {name.split(".", 2)[2]: values for name, values in t.items() if name.startswith(f"blk.{i}.")}
        normed = _rms(x, w["attn_norm.weight"], shape.eps)
        q = _rms((normed @ w["attn_q.weight"].T).reshape(n, shape.heads, d), w["attn_q_norm.weight"], shape.eps)
        k = _rms((normed @ w["attn_k.weight"].T).reshape(n, shape.kv_heads, d), w["attn_k_norm.weight"], shape.eps)
        v = (normed @ w["attn_v.weight"].T).reshape(n, shape.kv_heads, d)
        base = shape.rope_base_swa if shape.windowed(i) else shape.rope_base
        q, k = _rope(q, positions, base) / np.sqrt(d), _rope(k, positions, base)
        masked = (distance < 0) | ((distance >= shape.window) if shape.windowed(i) else False)
        out = np.empty_like(q)
        for head in range(shape.heads):
            kv = head * shape.kv_heads // shape.heads
            scores = np.where(masked, -np.inf, q[:, head] @ k[:, kv].T)
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, head] = (probs / probs.sum(axis=1, keepdims=True)) @ v[:, kv]
        attn = _rms(out.reshape(n, -1) @ w["attn_output.weight"].T, w["post_attention_norm.weight"], shape.eps)
        x = x + attn
        normed = _rms(x, w["ffn_norm.weight"], shape.eps)
        mlp = (_gelu_tanh(normed @ w["ffn_gate.weight"].T) * (normed @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T
        x = x + _rms(mlp, w["post_ffw_norm.weight"], shape.eps)
    return _rms(x[-1], t["output_norm.weight"], shape.eps) @ t["token_embd.weight"].T
