"""The value codec: one self-describing, checked value per cached tensor.

Layout (little-endian)::

    magic  b"KVSH"        4 bytes
    version               u8
    kind                  u8   (1 = prefix block, 2 = cross-attention K/V, 3 = a prefix block's
                               windowed layers)
    dtype                 u8   (1 = float32, 2 = float16, 3 = bfloat16)
    ndim                  u8
    dims                  u32 x ndim
    owner                 32 bytes: the hash the value was stored under
    payload length        u64 (bytes)
    checksum              16 bytes: xxh3-128 of the payload
    payload               raw tensor bytes, C order

Blocks use the canonical layout ``[layers, 2 (k, v), kv_heads, block_tokens, head_dim]``.
``owner`` makes a value copied under another key (another namespace, another prefix) a miss.
The checksum guards against corruption, not attackers (it is fast: it sits on the warm path); a
value read from a signed store was verified by its MAC already, and skips it.
A tensor holding NaN, infinity or a magnitude above ``MAX_ABS`` is refused too: served, it would
poison every later token of the request, and no real K/V holds one.
Decoding never copies the payload: the tensor is a read-only view of the value's bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum, StrEnum

import numpy as np
import xxhash

from cachestore.storage_dtype import BFLOAT16

MAGIC = b"KVSH"
MAX_ABS = 65504.0
"""Largest magnitude a stored K/V element may have: float16's largest finite value, which every
model that runs its K/V in float16 stays under. Larger values (1e19 and up make a tiny model's
logits NaN) are refused, so that what passes cannot blow up the arithmetic over it."""
VERSION = 1
_FIXED = struct.Struct("<4sBBBB")
_TAIL = struct.Struct("<32sQ16s")
_BF16_MAX_ABS = 0x477F
"""Magnitude bits of the largest bfloat16 within ``MAX_ABS`` (65280; the next one is 65536)."""
_BF16_INF = 0x7F80


class ValueKind(IntEnum):
    PREFIX_BLOCK = 1
    """A block's K/V of every layer, or of the layers that read every earlier position when the
    model has windowed ones (``cachestore.prefix.KVGeometry``)."""
    CROSS_KV = 2
    WINDOW_BLOCK = 3
    """A block's K/V of the windowed layers alone."""


_DTYPES = {np.dtype(np.float32): 1, np.dtype(np.float16): 2, BFLOAT16: 3}
_DTYPE_OF = {code: dtype for dtype, code in _DTYPES.items()}


class RejectReason(StrEnum):
    """Why a stored value was refused; the metrics count rejected values by these names."""

    FORMAT = "format"
    """Not a value of this codec, version, kind, dtype or shape, or cut short."""
    OWNER = "owner"
    """A valid value stored under another key."""
    CHECKSUM = "checksum"
    """The payload does not match its checksum."""
    NON_FINITE = "non_finite"
    """The tensor holds NaN or infinity."""
    OUT_OF_RANGE = "out_of_range"
    """The tensor holds a finite magnitude above ``MAX_ABS``."""
    UNSIGNED = "unsigned"
    """Counted by the signed store, not the codec: a signing key is configured and the value
    carries no signature."""
    SIGNATURE = "signature"
    """Counted by the signed store: the value's MAC does not verify under any configured key (forged,
    altered, copied under another key, or signed with a key this worker does not hold)."""
    LEASE = "lease"
    """Counted by the signed store: a lease whose MAC verifies but that is not honoured, its signed
    expiry past or further ahead than the longest lease (``cachestore.lease_terms``): a replay."""
    OVERSIZED = "oversized"
    """Counted by the Redis store: a value longer than its reader's bound (a block's exact size, a
    lease's largest, ``--cache-max-value-bytes``), read no further than one byte past it."""
    BAD_OUTPUT = "bad_output"
    """Counted by the engine, not the codec: values that passed every check, but the model's
    logits over them were NaN or infinite; the request's cached values are deleted and it is
    computed again without them."""


class CodecError(ValueError):
    """A stored value failed a check; the caller treats it as a miss and deletes it."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Expected:
    """What the reader requires of a value besides a valid checksum."""

    kind: ValueKind
    owner: bytes
    dtype: np.dtype
    shape: tuple[int, ...] | None = None
    """Exact shape, or None to accept any shape (checked by the caller)."""
    authenticated: bool = False
    """The value's bytes were verified by a MAC already: the checksum pass is skipped."""


def encoded_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    """The length in bytes of ``encode``'s value of a tensor of ``shape`` and ``dtype``: the most a
    reader that expects that shape reads (``KVStore.get``'s ``limit``)."""
    return _FIXED.size + 4 * len(shape) + _TAIL.size + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def encode(kind: ValueKind, owner: bytes, tensor: np.ndarray) -> bytes:
    """Serialises ``tensor`` (C-contiguous copy made if needed) under ``owner`` (32 bytes)."""
    if len(owner) != 32:
        raise ValueError("owner must be a 32-byte hash")
    payload = np.ascontiguousarray(tensor)
    raw = memoryview(payload.reshape(-1).view(np.uint8))  # bytes of any dtype, bfloat16's too
    header = _FIXED.pack(MAGIC, VERSION, int(kind), _DTYPES[payload.dtype], payload.ndim)
    header += struct.pack(f"<{payload.ndim}I", *payload.shape)
    header += _TAIL.pack(owner, raw.nbytes, xxhash.xxh3_128_digest(raw))
    return header + raw.tobytes()


@dataclass(frozen=True, slots=True)
class _Header:
    magic: bytes
    version: int
    kind: int
    dtype_code: int
    shape: tuple[int, ...]
    owner: bytes
    length: int
    checksum: bytes
    payload_offset: int


def _header(view: memoryview) -> _Header:
    try:
        magic, version, kind, dtype_code, ndim = _FIXED.unpack_from(view, 0)
        offset = _FIXED.size
        shape = struct.unpack_from(f"<{ndim}I", view, offset)
        offset += 4 * ndim
        owner, length, checksum = _TAIL.unpack_from(view, offset)
    except struct.error as exc:
        raise CodecError(RejectReason.FORMAT, f"truncated header ({len(view)} bytes)") from exc
    return _Header(magic, version, kind, dtype_code, tuple(shape), owner, length, checksum, offset + _TAIL.size)


def owner_of(value: bytes | memoryview) -> bytes:
    """The hash ``value`` says it was stored under, unchecked (for tools that rewrite values)."""
    return _header(memoryview(value)).owner


def dtype_of(value: bytes | memoryview) -> np.dtype | None:
    """The element type ``value`` says it holds, unchecked (for tools that rewrite values); None
    for an unknown code."""
    return _DTYPE_OF.get(_header(memoryview(value)).dtype_code)


def decode(value: bytes | memoryview, expected: Expected) -> np.ndarray:
    """Checks ``value`` against ``expected`` and returns a read-only view of its tensor."""
    view = memoryview(value)
    h = _header(view)
    if h.magic != MAGIC or h.version != VERSION:
        raise CodecError(RejectReason.FORMAT, f"unknown format {h.magic!r} v{h.version}")
    if h.kind != expected.kind:
        raise CodecError(RejectReason.FORMAT, f"value kind {h.kind}, expected {int(expected.kind)}")
    if h.owner != expected.owner:
        raise CodecError(RejectReason.OWNER, "value belongs to another key")
    dtype = _DTYPE_OF.get(h.dtype_code)
    if dtype != expected.dtype:
        raise CodecError(RejectReason.FORMAT, f"dtype code {h.dtype_code}, expected {expected.dtype}")
    if expected.shape is not None and h.shape != expected.shape:
        raise CodecError(RejectReason.FORMAT, f"shape {h.shape}, expected {expected.shape}")
    payload = view[h.payload_offset:]
    if len(payload) != h.length or h.length != int(np.prod(h.shape, dtype=np.int64)) * dtype.itemsize:
        raise CodecError(RejectReason.FORMAT, f"payload of {len(payload)} bytes, header says {h.length} for shape {h.shape}")
    if not expected.authenticated and xxhash.xxh3_128_digest(payload) != h.checksum:
        raise CodecError(RejectReason.CHECKSUM, "checksum mismatch")
    tensor = np.frombuffer(payload, dtype=dtype).reshape(h.shape)
    check_range(tensor)
    return tensor


def _largest_magnitude_bits(tensor: np.ndarray) -> int:
    """The largest of a 2-byte float tensor's sign-less bit patterns (NaN and infinity above every
    finite value, in float16 and bfloat16 alike). Two integer reductions and no temporary: as
    int16 the non-negative values order by magnitude, as uint16 the negative ones do (above
    0x8000). numpy's float16 reductions are scalar code (70 ms per 16 MiB, not 1)."""
    bits = tensor.view(np.uint16)
    positive = int(bits.view(np.int16).max())
    negative = int(bits.max()) - 0x8000
    return max(positive, negative)


def check_range(tensor: np.ndarray) -> None:
    """Refuses NaN, infinity and magnitudes above ``MAX_ABS``. Two reductions over the payload, like
    the checksum one pass each (about 1.4 ms per 16 MiB of float32 here); for float32 NaN
    propagates through min and max, and fails both comparisons."""
    if tensor.size == 0:
        return
    if tensor.dtype.itemsize == 2:
        top = _largest_magnitude_bits(tensor)
        if tensor.dtype == np.float16:
            # Every finite float16 is within MAX_ABS; NaN and infinity have an all-ones exponent.
            if top < 0x7C00:
                return
            raise CodecError(RejectReason.NON_FINITE, "tensor holds NaN or infinity")
        if top <= _BF16_MAX_ABS:
            return
        if top >= _BF16_INF:
            raise CodecError(RejectReason.NON_FINITE, "tensor holds NaN or infinity")
        raise CodecError(RejectReason.OUT_OF_RANGE, f"tensor holds bfloat16 magnitudes above {MAX_ABS:g}")
    lo, hi = tensor.min(), tensor.max()
    if -MAX_ABS <= lo and hi <= MAX_ABS:
        return
    if np.isfinite(lo) and np.isfinite(hi):
        raise CodecError(RejectReason.OUT_OF_RANGE, f"tensor holds magnitudes up to {max(-lo, hi):.3g} (limit {MAX_ABS:g})")
    raise CodecError(RejectReason.NON_FINITE, "tensor holds NaN or infinity")
