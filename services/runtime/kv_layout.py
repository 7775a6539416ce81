"""The ways a decoder graph can expose its self-attention cache (read from genai_config.json)."""

from __future__ import annotations

from enum import StrEnum


class KVLayout(StrEnum):
    """How a decoder graph exposes its self-attention cache.

    SEPARATE: ``past_key_values.N.key`` / ``.value`` in, ``present.N.key`` / ``.value`` out,
    each ``[batch, kv_heads, seq, head_size]``.
    COMBINED: ``past_N`` in, ``present_N`` out, ``[2 (k, v), batch, kv_heads, seq, head_size]``.
    """

    SEPARATE = "separate"
    COMBINED = "combined"
