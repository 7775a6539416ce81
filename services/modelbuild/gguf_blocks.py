"""A GGUF's quantized matmul weights kept as the file stores them, in ONNX Runtime's
``com.microsoft::MatMulNBits`` form (``kvshare fetch-model --weights gguf``).

Each block type below maps *exactly*: the MatMulNBits bytes and scales give back, bit for bit,
the values llama.cpp's own dequantization gives (``gguf.quants.dequantize``). Nothing is
re-quantized, so the folder holds the same model as the GGUF.

- ``Q8_0`` (32 int8 values q and one float16 scale d; value ``d * q``): 8 bits, the byte
  ``q + 128`` under MatMulNBits' default zero point 128.
- ``Q4_0`` (32 4-bit q, scale d; value ``d * (q - 8)``): 4 bits, default zero point 8.
- ``Q4_1`` (32 4-bit q, scale d and minimum m; value ``d * q + m``): 4 bits with default zero point
  8 gives ``d * (q - 8)``; the rest, ``m + 8 d`` per block, is a float ``mins`` table. MatMulNBits
  has no per-block offset in its fast kernels (a float zero point sends ONNX Runtime 1.32 to its
  dequantize-everything path), so the graph adds ``blocksum(x) @ mins`` beside it, as llama.cpp's
  Q4_1 dot product adds ``m * sum(y)``.
- ``Q5_0`` (32 5-bit q, scale d; value ``d * (q - 16)``): 8 bits, the byte ``q + 112``.
- ``Q6_K`` (super-blocks of 256: 16 groups of 16 6-bit q, an int8 scale s per group and one
  float16 d; value ``d * s * (q - 32)``): 8 bits per value, block 16, scale ``d * s`` (exact in
  float32: 11 + 8 bits), the byte ``q + 96``.
- ``Q4_K`` (super-blocks of 256: 8 groups of 32 4-bit q, 6-bit scale s and minimum m per group,
  float16 d and dmin; value ``d * s * q - dmin * m``): 4 bits, block 32, scale ``d * s`` and the
  ``mins`` table ``8 * d * s - dmin * m``, as Q4_1. Each product is exact in float32, so the
  value equals gguf's wherever ``8 * d * s - dmin * m`` is (its two terms' exponents within 7 of
  each other: every block of Gemma 3 270M's GGUF).

Layout: a GGUF stores a matmul weight as ``[out, in]`` rows of blocks along ``in``, which is
MatMulNBits' ``B`` layout (``[N, K / block, bytes per block]``); only the nibble order differs:
GGUF puts element j in the low and j + 16 in the high nibble of byte j, MatMulNBits elements 2i
and 2i + 1 in byte i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
"""Values per block of the 32-value types (the K-quants' super-blocks of 256 become blocks of 32
or 16)."""


@dataclass(frozen=True, slots=True)
class QuantBlocks:
    """A matmul weight ``[N, K]`` (N outputs, K inputs): value[n, k] =
    ``scales[n, b] * (q[n, k] - 2 ** (bits - 1)) + (mins[n, b] if mins is not None else 0)``
    with ``b = k // block_size``. ``data`` uint8 ``[N, K / block_size, block_size * bits / 8]``
    (MatMulNBits' packing), ``scales`` and ``mins`` float32 ``[N, K / block_size]``."""

    bits: int
    block_size: int
    data: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    gguf_type: str
    """The GGUF block type these came from (``Q4_1``), for the folder's description."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        n, blocks, _ = self.data.shape
        return n, blocks * self.block_size

    def rows(self, order: np.ndarray) -> QuantBlocks:
        """The same weight with its output rows taken in ``order`` (rows are whole blocks)."""
        return QuantBlocks(self.bits, self.block_size, self.data[order], self.scales[order],
                           None if self.mins is None else self.mins[order], self.gguf_type)

    @staticmethod
    def stacked(parts: list[QuantBlocks]) -> QuantBlocks:
        """One weight whose outputs are ``parts``' outputs in order (same bits, block and minimums)."""
        first = parts[0]
        mins = None if first.mins is None else np.concatenate([p.mins for p in parts])
        return QuantBlocks(first.bits, first.block_size, np.concatenate([p.data for p in parts]),
                           np.concatenate([p.scales for p in parts]), mins,
                           "+".join(dict.fromkeys(p.gguf_type for p in parts)))

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` values (for tests and checks; the graph never widens them)."""
        n, k = self.shape
        if self.bits == 8:
            q = self.data.astype(np.float32)
        else:
            q = np.empty((*self.data.shape[:2], self.block_size), np.float32)
            q[..., 0::2], q[..., 1::2] = self.data & 0xF, self.data >> 4
        values = self.scales[..., None] * (q - np.float32(2 ** (self.bits - 1)))
        if self.mins is not None:
            values += self.mins[..., None]
        return values.reshape(n, k)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block (``raw`` ``[..., bytes per block]``), as float32."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(quants: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes of 4-bit quants per block (element j low, j + 16 high) in MatMulNBits'
    packing (elements 2i low, 2i + 1 high)."""
    q = np.concatenate([quants & 0xF, quants >> 4], axis=-1)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _q8_0(b: np.ndarray) -> QuantBlocks:
    data = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return QuantBlocks(8, BLOCK, data, _halves(b, 0), None, "Q8_0")


def _q4_0(b: np.ndarray) -> QuantBlocks:
    return QuantBlocks(4, BLOCK, _nibbles(b[..., 2:]), _halves(b, 0), None, "Q4_0")


def _q4_1(b: np.ndarray) -> QuantBlocks:
    d, m = _halves(b, 0), _halves(b, 2)
    return QuantBlocks(4, BLOCK, _nibbles(b[..., 4:]), d, m + np.float32(8) * d, "Q4_1")


def _q5_0(b: np.ndarray) -> QuantBlocks:
    high = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)[..., 0]
    q = np.concatenate([b[..., 6:] & 0xF, b[..., 6:] >> 4], axis=-1).astype(np.uint8)
    q |= (((high[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    return QuantBlocks(8, BLOCK, q + np.uint8(112), _halves(b, 0), None, "Q5_0")


def _q6_k(b: np.ndarray) -> QuantBlocks:
    rows, supers = b.shape[:2]
    low, high = b[..., :128].reshape(rows, supers, 2, 64), b[..., 128:192].reshape(rows, supers, 2, 32)
    q = np.empty((rows, supers, 2, 4, 32), np.uint8)  # [half of 128, quarter of 32, element]
    for part in range(4):
        nibbles = low[..., (part % 2) * 32 : (part % 2) * 32 + 32]
        q[:, :, :, part] = ((nibbles & 0xF) if part < 2 else (nibbles >> 4)) | (((high >> (2 * part)) & 3) << 4)
    scales = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _halves(b, 208)[..., None]
    return QuantBlocks(8, 16, (q.reshape(rows, supers * 16, 16) + np.uint8(96)),
                       (d * scales).reshape(rows, supers * 16), None, "Q6_K")


def _q4_k(b: np.ndarray) -> QuantBlocks:
    rows, supers = b.shape[:2]
    packed = b[..., 4:16].reshape(rows, supers, 3, 4)
    first, second, third = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    scale = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 2) & 0x30)], axis=-1).astype(np.float32)
    minimum = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 2) & 0x30)], axis=-1).astype(np.float32)
    d = _halves(b, 0)[..., None] * scale
    dm = _halves(b, 2)[..., None] * minimum
    quants = b[..., 16:].reshape(rows, supers, 4, 32)  # 4 chunks of 64: low nibbles, then high
    q = np.stack([quants & 0xF, quants >> 4], axis=3).reshape(rows, supers * 8, 32)
    return QuantBlocks(4, BLOCK, (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8),
                       d.reshape(rows, supers * 8), (np.float32(8) * d - dm).reshape(rows, supers * 8), "Q4_K")


_TYPES = {"Q8_0": (34, 32, _q8_0), "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1), "Q5_0": (22, 32, _q5_0),
          "Q4_K": (144, 256, _q4_k), "Q6_K": (210, 256, _q6_k)}
MAPPED_TYPES = tuple(_TYPES)
"""GGUF block types kept as blocks; a tensor of any other type is dequantized to float32."""


def blocks_of(type_name: str, raw: np.ndarray, rows: int, columns: int) -> QuantBlocks | None:
    """The blocks of a 2-D GGUF tensor of ``rows`` x ``columns`` (``[out, in]``) whose bytes are
    ``raw``; None when its type is not one of MAPPED_TYPES."""
    if type_name not in _TYPES:
        return None
    size, values, convert = _TYPES[type_name]
    if columns % values:
        return None
    return convert(np.asarray(raw, np.uint8).reshape(rows, columns // values, size))
