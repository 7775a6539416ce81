"""Shapes of the seeded models that `kvshare build-model` writes, and the element types it writes."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_DTYPES = ("float32", "float16", "bfloat16")
"""The element types of `kvshare build-model --dtype`: the builders make float32 graphs and
services/modelbuild/graph_dtype.py converts them to the others (here, not there, so that the CLI
lists them without importing onnx)."""


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """A Llama-shaped decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    init_std: float = 0.05
    # Standard deviation of one logit, set by scaling the output head: seeded random weights
    # otherwise give next-token distributions so flat that greedy choices are near ties.
    logit_std: float = 16.0
    sliding_window: int = 0
    """Positions a windowed layer's query sees, its own included (GroupQueryAttention's
    ``local_window_size``); 0: no layer is windowed."""
    window_layers: tuple[int, ...] = ()
    """The layers that see only ``sliding_window`` positions."""

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into num_heads, num_heads into num_kv_heads")


DECODER_PRESETS: dict[str, DecoderShape] = {
    "tiny": DecoderShape(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=176,
        vocab_size=512, context_length=1024,
    ),
    # Gemma 3's mix in miniature: two of three layers see only the last 40 positions.
    "tiny-window": DecoderShape(
        num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=176,
        vocab_size=512, context_length=1024, sliding_window=40, window_layers=(0, 1),
    ),
    "small": DecoderShape(
        num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, intermediate_size=704,
        vocab_size=2048, context_length=2048,
    ),
    "bench": DecoderShape(
        num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1408,
        vocab_size=8000, context_length=4096,
    ),
}


@dataclass(frozen=True, slots=True)
class EncoderDecoderShape:
    """A T5-like text-to-text model: a bidirectional encoder whose output is projected once into
    every decoder layer's cross-attention K/V, and a causal decoder with self-attention K/V.
    Pre-RMSNorm blocks, SwiGLU MLPs, learned absolute positions, multi-head attention."""

    encoder_layers: int
    decoder_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    """Most decoder tokens (prompt + generated)."""
    encoder_context_length: int
    """Most encoder input tokens."""
    rms_eps: float = 1e-5
    init_std: float = 0.05
    logit_std: float = 16.0

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


ENCODER_DECODER_PRESETS: dict[str, EncoderDecoderShape] = {
    "tiny": EncoderDecoderShape(
        encoder_layers=2, decoder_layers=2, hidden_size=64, num_heads=4, intermediate_size=176,
        vocab_size=512, context_length=512, encoder_context_length=512,
    ),
    "small": EncoderDecoderShape(
        encoder_layers=4, decoder_layers=4, hidden_size=256, num_heads=8, intermediate_size=704,
        vocab_size=2048, context_length=1024, encoder_context_length=1024,
    ),
    "bench": EncoderDecoderShape(
        encoder_layers=6, decoder_layers=6, hidden_size=512, num_heads=8, intermediate_size=1408,
        vocab_size=8000, context_length=2048, encoder_context_length=2048,
    ),
}
