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

Layout: a GGUF stores a matmul weight as ``[out, in]`` rows of blocks along ``in``, which is
MatMulNBits' ``B`` layout (``[N, K / block, bytes per block]``); only the nibble order differs:
GGUF puts element j in the low and j + 16 in the high nibble of byte j, MatMulNBits elements 2i
and 2i + 1 in byte i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
"""Values per block of every type mapped here."""


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


_TYPES = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}
MAPPED_TYPES = tuple(_TYPES)
"""GGUF block types kept as blocks; a tensor of any other type is dequantized to float32."""


def blocks_of(type_name: str, raw: np.ndarray, rows: int, columns: int) -> QuantBlocks | None:
    """The blocks of a 2-D GGUF tensor of ``rows`` x ``columns`` (``[out, in]``) whose bytes are
    ``raw``; None when its type is not one of MAPPED_TYPES."""
    if type_name not in _TYPES or columns % BLOCK:
        return None
    size, convert = _TYPES[type_name]
    return convert(np.asarray(raw, np.uint8).reshape(rows, columns // BLOCK, size))
