"""A plain numpy Whisper encoder over a CTranslate2 model's variables, written from the
architecture's definition (OpenAI's whisper/model.py) rather than from the ONNX builder, to check
the converted graph against: two convolutions with GELU, sinusoidal positions, pre-norm
self-attention and feed-forward layers, a final LayerNorm, then each decoder layer's cross K/V."""

from __future__ import annotations

import math

import numpy as np

from services.modelbuild.ctranslate2_model import CTranslate2Model


def _f32(model: CTranslate2Model, name: str) -> np.ndarray:
    return model[name].astype(np.float64)


def _gelu(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _layer_norm(model: CTranslate2Model, x: np.ndarray, prefix: str) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * _f32(model, f"{prefix}/gamma") + _f32(model, f"{prefix}/beta")


def _linear(model: CTranslate2Model, x: np.ndarray, prefix: str) -> np.ndarray:
    return x @ _f32(model, f"{prefix}/weight").T + _f32(model, f"{prefix}/bias")


def _conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """x ``[channels_in, frames]``, weight ``[out, in, 3]``, padding 1."""
    padded = np.pad(x, ((0, 0), (1, 1)))
    frames = (x.shape[1] - 1) // stride + 1
    taps = np.stack([padded[:, k:k + stride * frames:stride] for k in range(3)])  # [3, in, frames]
    return np.einsum("oik,kif->of", weight, taps) + bias[:, None]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def cross_kv(model: CTranslate2Model, features: np.ndarray) -> np.ndarray:
    """features ``[mels, frames]`` -> ``[decoder_layers, 2, heads, frames / 2, head]`` (float64)."""
    heads = int(model["encoder/num_heads"])
    x = _gelu(_conv1d(features.astype(np.float64), _f32(model, "encoder/conv1/weight"), _f32(model, "encoder/conv1/bias"), 1))
    x = _gelu(_conv1d(x, _f32(model, "encoder/conv2/weight"), _f32(model, "encoder/conv2/bias"), 2)).T
    x = x + _f32(model, "encoder/position_encodings/encodings")[:x.shape[0]]
    hidden = x.shape[1]
    head = hidden // heads
    layer = 0
    while f"encoder/layer_{layer}/ffn/linear_0/weight" in model.variables:
        p = f"encoder/layer_{layer}"
        qkv = _linear(model, _layer_norm(model, x, f"{p}/self_attention/layer_norm"), f"{p}/self_attention/linear_0")
        q, k, v = (qkv[:, i * hidden:(i + 1) * hidden].reshape(-1, heads, head).transpose(1, 0, 2) for i in range(3))
        attn = (_softmax(q @ k.transpose(0, 2, 1) / math.sqrt(head)) @ v).transpose(1, 0, 2).reshape(-1, hidden)
        x = x + _linear(model, attn, f"{p}/self_attention/linear_1")
        inner = _gelu(_linear(model, _layer_norm(model, x, f"{p}/ffn/layer_norm"), f"{p}/ffn/linear_0"))
        x = x + _linear(model, inner, f"{p}/ffn/linear_1")
        layer += 1
    x = _layer_norm(model, x, "encoder/layer_norm")
    layers = []
    layer = 0
    while f"decoder/layer_{layer}/attention/linear_1/weight" in model.variables:
        kv = _linear(model, x, f"decoder/layer_{layer}/attention/linear_1")
        layers.append(np.stack([kv[:, i * hidden:(i + 1) * hidden].reshape(-1, heads, head).transpose(1, 0, 2)
                                for i in range(2)]))
        layer += 1
    return np.stack(layers)
