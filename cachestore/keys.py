"""Block keys: a chained cryptographic hash over blocks of prompt tokens.

Invariants (docs/design.md, 1-2):
- ``h_0 = H(namespace)``, ``h_i = H(h_{i-1} || token ids of block i)``, ``H`` = BLAKE2b-256 over a
  canonical encoding (token ids as little-endian int32). A block's hash therefore names the whole
  prefix up to and including that block, not only the block's own tokens.
- The namespace holds everything the tensor depends on besides the tokens: the format version,
  the model fingerprint, the block size, the stored dtype and layout, the authenticated tenant,
  the request's salt and, for models answered bit for bit, the numerics fingerprint. Two requests share a block only when all of these are equal.
- With a namespace secret, ``h_0`` is keyed BLAKE2b under it: without the secret nobody can compute
  a key from the model and the tokenizer (both public through the API), so nobody can plant a
  value where a victim's prompt will look, nor test whether a prompt is cached by reading Redis.
- No ``hash()`` (salted per process) and no pickle: the same prompt gives the same keys in every
  process on every machine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)
"""32-byte digest naming one block of K/V (and, through the chain, every block before it)."""

KEY_FORMAT_VERSION = 1
KEY_PREFIX = "kvshare:v1:"
_DIGEST_BYTES = 32


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything a cached tensor depends on besides the prompt tokens."""

    model_fingerprint: str
    block_size: int
    dtype: str
    layout: str
    salt: str = ""
    tenant: str = ""
    """The caller's authenticated tenant id (empty without API keys): tenants never share blocks."""
    extra: str = ""
    """Further inputs the K/V depends on, e.g. the encoder-input hash of an encoder-decoder model."""
    numerics: str = ""
    """What the K/V's bits depend on besides the model where replicas must agree bit for bit (the
    runtime, the CPU's kernels, the threads: ``numerics_probe``); empty where they may differ
    within a tolerance."""
    format_version: int = KEY_FORMAT_VERSION
    secret: bytes = field(default=b"", repr=False)
    """The fleet's namespace secret (empty: none); keys the hash, never part of the hashed text."""

    def digest(self) -> BlockHash:
        public = {k: v for k, v in asdict(self).items() if k != "secret"}
        canonical = json.dumps(public, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        key = hashlib.blake2b(self.secret, digest_size=_DIGEST_BYTES).digest() if self.secret else b""
        return BlockHash(hashlib.blake2b(canonical.encode(), digest_size=_DIGEST_BYTES, key=key).digest())


def block_hashes(namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial last block gets none)."""
    size = namespace.block_size
    count = len(token_ids) // size
    tokens = np.asarray(token_ids[: count * size], dtype="<i4")
    previous = namespace.digest()
    hashes: list[BlockHash] = []
    for i in range(count):
        h = hashlib.blake2b(previous, digest_size=_DIGEST_BYTES)
        h.update(tokens[i * size : (i + 1) * size].tobytes())
        previous = BlockHash(h.digest())
        hashes.append(previous)
    return hashes


def block_key(block_hash: BlockHash) -> str:
    """The store key of a block: a fixed prefix and the hash in hex."""
    return KEY_PREFIX + "blk:" + block_hash.hex()


def window_block_key(block_hash: BlockHash) -> str:
    """The store key of a block's windowed layers (models with sliding-window layers only)."""
    return KEY_PREFIX + "blkw:" + block_hash.hex()


def lease_key(block_hash: BlockHash) -> str:
    """The store key of the lease on computing the run of blocks that starts at this block."""
    return KEY_PREFIX + "lease:" + block_hash.hex()


LEASE_KEY_PATTERN = KEY_PREFIX + "lease:*"
"""Every lease key (a Redis SCAN pattern)."""

_TOKEN_BYTES = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-_")


def progress_channel(holder: bytes) -> str | None:
    """The channel a lease holder announces its progress on (``KVStore.announce``): one per
    holder token, whichever of its lease keys a waiter found, so that each chunk is one announcement
    however long the prompt. None for a token no worker makes (at most 64 bytes of letters, digits
    and ``.-_``): read from a store anyone can write to, it is nobody to listen to."""
    if not 0 < len(holder) <= 64 or not _TOKEN_BYTES.issuperset(holder):
        return None
    return KEY_PREFIX + "progress:" + holder.decode("ascii")


def encoder_input_hash(namespace: Namespace, array: np.ndarray) -> BlockHash:
    """Names an encoder input: its dtype, shape and little-endian bytes under ``namespace``.

    The cross-attention K/V of an encoder-decoder model depend on nothing else, and the decoder's
    self-attention K/V depend on them (cross-attention feeds every decoder layer), so this hash
    goes into the namespace of that model's prefix blocks too (``Namespace.extra``).
    """
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    h = hashlib.blake2b(namespace.digest(), digest_size=_DIGEST_BYTES)
    h.update(f"{little.dtype.str}{list(little.shape)}".encode())
    h.update(little.tobytes())
    return BlockHash(h.digest())


def cross_key(input_hash: BlockHash) -> str:
    """The store key of an encoder input's cross-attention K/V."""
    return KEY_PREFIX + "xkv:" + input_hash.hex()
