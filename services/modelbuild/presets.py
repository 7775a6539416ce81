"""Shapes of the seeded models that `kvshare build-model` writes, and the element types it writes."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_DTYPES = ("float32", "float16", "bfloat16")
"""The element types of `kvshare build-model --dtype`: the builders make float32 graphs and
services/modelbuild/graph_dtype.py converts them to the others (here, not there, so that the CLI
lists them without importing onnx)."""
GGUF_WEIGHTS = ("fp32", "gguf", "int8")
"""A converted GGUF's matmul weights: dequantized float32, its own quantized blocks
(services/modelbuild/gguf_blocks.py), or re-quantized to 8 bits by ONNX Runtime's quantizer."""


ACTIVATIONS = ("silu", "gelu_tanh")
"""The gates of the decoder MLP: SwiGLU (Llama) and GeGLU with GELU's tanh approximation (Gemma)."""


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """A decoder: RMSNorm, rotary positions, grouped-query attention, gated MLP. The defaults past
    ``logit_std`` describe Llama; Gemma 3 sets them (services/modelbuild/gemma_graph.py)."""

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
    head_dim: int = 0
    """Width of one attention head; 0: ``hidden_size // num_heads``. Set, the queries are
    ``num_heads * head_dim`` wide, which need not be ``hidden_size`` (Gemma 3 270M: 4 x 256 > 640)."""
    qk_norm: bool = False
    """RMSNorm over every query and key head (weights ``[head_size]``) before the rotary."""
    post_norms: bool = False
    """RMSNorm of the attention's and of the MLP's output before each residual add."""
    activation: str = "silu"
    """The MLP's gate, one of ACTIVATIONS."""
    embedding_scale: float = 1.0
    """Factor on the token embeddings as they enter the first layer (float32 in the graph), never
    on the tied output head."""
    rope_theta_windowed: float | None = None
    """Rotary base of the windowed layers; None: ``rope_theta`` there too."""
    sliding_window: int = 0
    """Keys a windowed layer's query sees: its own and the ``sliding_window - 1`` before it."""
    windowed_layers: tuple[int, ...] = ()
    """The layers that attend within ``sliding_window``; the others see every earlier key."""

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def rope_base(self, layer: int) -> float:
        if layer in self.windowed_layers and self.rope_theta_windowed is not None:
            return self.rope_theta_windowed
        return self.rope_theta

    def window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees at most, counting its own; 0: all."""
        return self.sliding_window if layer in self.windowed_layers else 0

    def gemma_features(self) -> list[str]:
        """The fields that differ from a Llama decoder, by name (empty for Llama). A sliding window
        is not one: the Llama graph takes it (Mistral-style; the ``tiny-window`` preset)."""
        llama = DecoderShape(1, 1, 1, 1, 1, 1, 1)
        names = ("qk_norm", "post_norms", "activation", "embedding_scale", "rope_theta_windowed")
        features = [n for n in names if getattr(self, n) != getattr(llama, n)]
        return features + (["head_dim"] if self.head_size * self.num_heads != self.hidden_size else [])

    def __post_init__(self) -> None:
        if (not self.head_dim and self.hidden_size % self.num_heads) or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into num_heads (unless head_dim is set), num_heads into "
                             "num_kv_heads")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if bool(self.sliding_window) != bool(self.windowed_layers) or self.sliding_window < 0:
            raise ValueError("a sliding window needs windowed layers and windowed layers a positive window")
        if any(not 0 <= layer < self.num_layers for layer in self.windowed_layers):
            raise ValueError(f"windowed layers {self.windowed_layers} are not all among {self.num_layers} layers")


DECODER_PRESETS: dict[str, DecoderShape] = {
    "tiny": DecoderShape(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=176,
        vocab_size=512, context_length=1024,
    ),
    # Gemma 3's mix in miniature: two of three layers see only the last 40 positions.
    "tiny-window": DecoderShape(
        num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=176,
        vocab_size=512, context_length=1024, sliding_window=40, windowed_layers=(0, 1),
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
