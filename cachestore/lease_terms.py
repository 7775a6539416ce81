"""What a signed lease says besides who holds it: when it ends, so that a lease read from the store
and written back later (a replay) holds nobody back once that time has passed.

A MAC over the holder's token alone (``SignedStore`` before this) let whoever can read and write
Redis copy a real lease while its holder computed, and write it back with any expiry: the copy
verified for ever. So the signed value of a lease is, inside the signature envelope
(``cachestore.signing``; little-endian)::

    magic    b"KVL1"   4 bytes
    expiry   u64       when the lease ends: wall-clock milliseconds since the epoch, by the
                       holder's clock (the holder's Redis ``PX`` is the same length)
    token    bytes     the holder's token (``services.engine.leases.Tokens``): its worker process,
                       fresh each time the process starts, and its row number, never reused by
                       that process, so no two claims sign the same token (a nonce)

Every renewal (``KVStore.renew``) signs a fresh expiry. A worker reading a lease honours it only
while ``now - skew <= expiry <= now + max_ttl + skew`` by its own clock (``LeaseTerms.judge``):
a replay is worth at most what remains of the lease it copied, plus the skew, and a lease claiming
to end further ahead than any worker signs is refused. Clocks across machines differ: ``skew``
is how much they may, and it widens both ends of the window.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum

MAGIC = b"KVL1"
_HEAD = struct.Struct("<4sQ")


class LeaseFault(StrEnum):
    """Why a lease whose MAC verifies is still not honoured (the log says which)."""

    MALFORMED = "malformed"
    """Not a lease of this format: written by a worker of an older version (whose lease carries no
    expiry), or a signed value of another kind."""
    EXPIRED = "expired"
    """Its signed expiry passed more than the clock skew ago: a replay of an old lease."""
    TOO_LONG = "too_long"
    """Its signed expiry lies further ahead than the longest lease plus the clock skew."""


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """How long a lease may live, and how far apart the fleet's clocks may be (ms)."""

    max_ttl_ms: int = 60_000
    """No lease is signed, or set to expire, further ahead than this; a lease read with a signed
    expiry beyond it (plus ``clock_skew_ms``) is refused. A holder renews its leases with every
    chunk it publishes, so this need only exceed one chunk's time on the slowest worker."""
    clock_skew_ms: int = 1_000
    """How far apart the wall clocks of two workers may be: a lease is honoured until this long
    after its signed expiry, and while it ends no further than ``max_ttl_ms`` plus this ahead."""

    def ttl_ms(self, requested_ms: int) -> int:
        """The lifetime a lease asked to live ``requested_ms`` gets (at least 1 ms, at most the maximum)."""
        return max(1, min(requested_ms, self.max_ttl_ms))

    def judge(self, expiry_ms: int, now_ms: int) -> LeaseFault | None:
        """Why a lease signed to end at ``expiry_ms`` is not honoured at ``now_ms`` (None: it is)."""
        if expiry_ms < now_ms - self.clock_skew_ms:
            return LeaseFault.EXPIRED
        if expiry_ms > now_ms + self.max_ttl_ms + self.clock_skew_ms:
            return LeaseFault.TOO_LONG
        return None


@dataclass(frozen=True, slots=True)
class LeaseValue:
    """A lease as signed: its holder's token and when it ends (epoch ms)."""

    token: bytes
    expiry_ms: int

    def pack(self) -> bytes:
        return _HEAD.pack(MAGIC, self.expiry_ms) + self.token

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> LeaseValue | None:
        """The lease in ``payload`` (a verified signature's value), or None when it is not one."""
        if len(payload) <= _HEAD.size or bytes(payload[:4]) != MAGIC:
            return None
        _, expiry_ms = _HEAD.unpack_from(payload, 0)
        return cls(bytes(payload[_HEAD.size:]), expiry_ms)
