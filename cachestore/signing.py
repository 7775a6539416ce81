"""Signed values: a MAC over a stored value's key, envelope header and bytes, with rotating keys.

Anyone who can reach Redis can write to it, and the codec's checksum stops corruption, not
attackers. With a keyring configured, every value written carries a MAC computed with the
current key, and a value is used only if its MAC verifies under one of the configured keys.

Envelope (little-endian), wrapped around the codec's value::

    magic  b"KVSG"        4 bytes
    version               u8
    key id length         u8   (1 .. 32)
    key id                ASCII
    padding               zero bytes up to a multiple of 16 from the start
    tag                   32 bytes: keyed BLAKE3 of (DOMAIN, store key length u32, store key,
                          the envelope header up to the tag, value)
    value                 the codec's bytes, unchanged

The padding keeps the codec's tensor as aligned inside the envelope as it is alone: numpy is slower
over a misaligned float32 buffer (the range check's min and max over 16 MiB: 1.5 ms aligned, 2.1 ms
not, here). The store key is under the MAC, so a valid value copied under another key is refused (the
codec's owner field refuses it too, but the MAC does not rely on it). Keyed BLAKE3 is a PRF (the
BLAKE3 paper's keyed mode), and it is fast: 4.3 ms per 16 MiB on one core here against 14 ms for
HMAC-SHA256, which matters because every warm start verifies its whole prefix.
"""

from __future__ import annotations

import hmac
import re
import struct
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import blake3

from cachestore.secret_files import SecretFileError, check_secret, field_lines

MAGIC = b"KVSG"
VERSION = 1
TAG_BYTES = 32
DOMAIN = b"kvshare cache value v1\x00"
_KDF_CONTEXT = "kvshare 2026-11-29 cache value signing key"
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")
_HEAD = struct.Struct("<4sBB")
_PARALLEL_BYTES = 256 << 10
_ALIGN = 16


def _aligned(length: int) -> int:
    return -(-length // _ALIGN) * _ALIGN


MAX_ENVELOPE_BYTES = _aligned(_HEAD.size + 32) + TAG_BYTES
"""The most an envelope adds to a value (its longest key id): what a reader that bounds a value
allows on top for its envelope (``SignedStore``)."""


class VerifyFailure(StrEnum):
    """Why a stored value was not accepted as signed."""

    UNSIGNED = "unsigned"
    """No envelope: written by a worker without a signing key, or by someone else."""
    SIGNATURE = "signature"
    """An envelope whose MAC does not verify, or whose key id is not configured here."""


@dataclass(frozen=True)
class Keyring:
    """Named 32-byte MAC keys. ``signing_id`` names the key that signs; every key verifies."""

    signing_id: str
    keys: dict[str, bytes] = field(repr=False)

    @classmethod
    def from_secrets(cls, secrets: list[tuple[str, str]]) -> Keyring:
        """``secrets``: (key id, secret text) pairs, the first one signing."""
        keys = {key_id: blake3.blake3(secret.encode(), derive_key_context=_KDF_CONTEXT).digest()
                for key_id, secret in secrets}
        return cls(secrets[0][0], keys)

    @classmethod
    def load(cls, path: Path) -> Keyring:
        """Reads ``KEY_ID SECRET`` lines (``#`` comments and blank lines ignored); the first key signs
        and every key verifies, so a rotation is: add the new key below the current one on every
        worker, then move it to the top, then remove the old one."""
        secrets: list[tuple[str, str]] = []
        for where, parts in field_lines(path, "signing key file"):
            if len(parts) != 2:
                raise SecretFileError(f"{where}: expected 'KEY_ID SECRET' (two fields), got {len(parts)}")
            key_id, secret = parts
            if not _KEY_ID.fullmatch(key_id):
                raise SecretFileError(f"{where}: key id must be 1 to 32 of A-Z a-z 0-9 . _ -")
            check_secret(secret, where, "secret")
            if any(key_id == seen for seen, _ in secrets):
                raise SecretFileError(f"{where}: key id {key_id!r} appears twice")
            secrets.append((key_id, secret))
        if not secrets:
            raise SecretFileError(f"{path}: no key: write one 'KEY_ID SECRET' line (e.g. k1 $(openssl rand -hex 32))")
        return cls.from_secrets(secrets)

    def sign(self, store_key: str, value: bytes | memoryview) -> bytes:
        """The envelope of ``value`` under ``store_key``, signed with the signing key."""
        key_id = self.signing_id.encode()
        head = _HEAD.pack(MAGIC, VERSION, len(key_id)) + key_id
        head += bytes(_aligned(len(head)) - len(head))
        return head + _tag(self.keys[self.signing_id], store_key, head, value) + bytes(value)

    def verify(self, store_key: str, envelope: bytes | memoryview) -> memoryview | VerifyFailure:
        """The value inside ``envelope`` (a view, no copy) if its MAC verifies under ``store_key``
        and one of the configured keys, else why not."""
        view = memoryview(envelope)
        if bytes(view[:4]) != MAGIC:
            return VerifyFailure.UNSIGNED
        try:
            _, version, id_length = _HEAD.unpack_from(view, 0)
        except struct.error:
            return VerifyFailure.SIGNATURE
        head_end = _aligned(_HEAD.size + id_length)
        key = self.keys.get(bytes(view[_HEAD.size:_HEAD.size + id_length]).decode("ascii", "replace"))
        if version != VERSION or key is None or len(view) < head_end + TAG_BYTES:
            return VerifyFailure.SIGNATURE
        value = view[head_end + TAG_BYTES:]
        expected = _tag(key, store_key, view[:head_end], value)
        # compare_digest: the time taken must not tell a forger how many leading bytes were right.
        if not hmac.compare_digest(expected, view[head_end:head_end + TAG_BYTES]):
            return VerifyFailure.SIGNATURE
        return value


def _tag(key: bytes, store_key: str, head: bytes | memoryview, value: bytes | memoryview) -> bytes:
    encoded_key = store_key.encode()
    # A block of a real model is hundreds of KiB: hashing it on every core cuts the warm path's cost
    # (BLAKE3's tree splits it; the GIL is released meanwhile). Small values stay on one thread.
    threads = blake3.blake3.AUTO if len(value) >= _PARALLEL_BYTES else 1
    h = blake3.blake3(key=key, max_threads=threads)
    h.update(DOMAIN + struct.pack("<I", len(encoded_key)) + encoded_key)
    h.update(head)
    h.update(value)
    return h.digest()
