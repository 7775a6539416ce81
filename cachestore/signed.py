"""A store whose values are signed on the way in and verified on the way out.

It sits directly on the shared tier (below a worker's L1), so a value that does not verify never
reaches the L1, the codec or the model. Such a value is a miss: counted by reason
(``unsigned``/``signature``), logged once per burst, and deleted, so the worker's next publish of
that block (set-if-absent) replaces it with a signed one. Leases are signed with their expiry
(``cachestore.lease_terms``), and one that does not verify, or whose expiry is past or too far
ahead, holds nobody back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from cachestore.codec import RejectReason
from cachestore.lease_terms import LeaseFault, LeaseTerms, LeaseValue
from cachestore.ratelimit import RateLimitedLog
from cachestore.signing import MAX_ENVELOPE_BYTES, Keyring, VerifyFailure
from cachestore.stats import CacheStats
from cachestore.store import KVStore, Notices

log = logging.getLogger(__name__)
_refused = RateLimitedLog(log)
_REASONS = {VerifyFailure.UNSIGNED: RejectReason.UNSIGNED, VerifyFailure.SIGNATURE: RejectReason.SIGNATURE}


def _enveloped(limits: Sequence[int] | None) -> list[int] | None:
    """Limits on values as the inner store holds them: each with room for its envelope."""
    return None if limits is None else [limit + MAX_ENVELOPE_BYTES for limit in limits]


@dataclass(frozen=True, slots=True)
class _Held:
    """A lease this worker holds: its token and the envelope it wrote last, the value that a
    release compares and deletes and a renewal replaces (each renewal signs a new expiry)."""

    token: bytes
    envelope: bytes
    expiry_ms: int


class SignedStore(KVStore):
    authenticated = True

    def __init__(self, inner: KVStore, keyring: Keyring, stats: CacheStats, lease_terms: LeaseTerms = LeaseTerms(),
                 clock: Callable[[], float] | None = None) -> None:
        """``clock``: wall-clock seconds since the epoch (``time.time``; tests pass their own)."""
        self.inner = inner
        self.keyring = keyring
        self.stats = stats
        self.lease_terms = lease_terms
        # Looked up at each call, not bound here: tests move the clock by patching time.time.
        self.clock = clock or (lambda: time.time())
        self.name = f"signed({inner.name})"
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        """Leases this worker holds, by key."""

    def get(self, key: str, limit: int | None = None) -> memoryview | None:
        return self.get_many([key], None if limit is None else [limit])[0]

    def get_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> list[memoryview | None]:
        refused: list[str] = []
        values = [None if envelope is None else self._verified(key, envelope, refused)
                  for key, envelope in zip(keys, self.inner.get_many(keys, _enveloped(limits)), strict=True)]
        if refused:
            self.inner.delete(refused)
        return values

    def iter_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> Iterator[memoryview | None]:
        refused: list[str] = []
        envelopes = zip(keys, self.inner.iter_many(keys, _enveloped(limits)), strict=False)
        try:
            for key, envelope in envelopes:
                yield None if envelope is None else self._verified(key, envelope, refused)
        finally:
            # A caller that stopped early (at a miss or a refused value) leaves the rest unread:
            # they are read anyway to free the connection, so they are verified too, and every
            # forged value is deleted now, letting the next publish (set-if-absent) replace it.
            for key, envelope in envelopes:
                if envelope is not None:
                    self._verified(key, envelope, refused)
            if refused:
                self.inner.delete(refused)

    def _verified(self, key: str, envelope: bytes, refused: list[str]) -> memoryview | None:
        """The value inside ``envelope`` if its MAC verifies, else None (counted, logged, and its
        key added to ``refused`` for deletion)."""
        verified = self.keyring.verify(key, envelope)
        if isinstance(verified, VerifyFailure):
            self.stats.count("rejected_values", _REASONS[verified])
            _refused.warning("cache value %s refused (%s); deleted, computing instead", key, verified.value)
            refused.append(key)
            return None
        return verified

    def put(self, key: str, value: bytes) -> bool:
        return self.put_many([(key, value)]) > 0

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        return self.inner.put_many([(key, self.keyring.sign(key, value)) for key, value in items])

    def delete(self, keys: Sequence[str]) -> None:
        self.inner.delete(keys)

    def claim(self, key: str, token: bytes, ttl_ms: int) -> bytes | None:
        """Leases are signed like values, with their expiry (``cachestore.lease_terms``): a lease
        anyone could write, or copy and write back later, would let them make every worker wait. A
        holder whose lease does not verify, or whose signed expiry is past or too far ahead, is
        nobody: that lease is deleted (compare-and-delete: only what was read) and claimed once
        more, so that this worker computes as the holder and the fleet's others wait for it."""
        for attempt in range(2):
            held = self._signed(key, token, ttl_ms)
            holder = self.inner.claim(key, held.envelope, self.lease_terms.ttl_ms(ttl_ms))
            if holder is None:
                return None
            if holder == held.envelope:
                with self._lock:
                    # Leases whose release failed (the store was down) expired meanwhile: forgotten.
                    now_ms = int(self.clock() * 1e3)
                    for gone in [k for k, h in self._held.items() if h.expiry_ms < now_ms]:
                        del self._held[gone]
                    self._held[key] = held
                return token
            found = self._lease_token(key, holder)
            if found is not None or attempt:
                return found
            self.inner.release(key, holder)
        return None

    def holder(self, key: str) -> bytes | None:
        holder = self.inner.holder(key)
        return None if holder is None else self._lease_token(key, holder)

    def release(self, key: str, token: bytes) -> None:
        with self._lock:
            held = self._held.get(key)
            if held is None or held.token != token:
                return
            del self._held[key]
        self.inner.release(key, held.envelope)

    def renew(self, key: str, token: bytes, ttl_ms: int, replacement: bytes | None = None) -> bool:
        """Signs a fresh expiry: the renewed lease replaces the one this worker wrote last
        (compare-and-set), so a copy of an earlier one is worth no more than its own expiry."""
        with self._lock:
            held = self._held.get(key)
        if held is None or held.token != token:
            return False
        fresh = self._signed(key, token, ttl_ms)
        renewed = self.inner.renew(key, held.envelope, self.lease_terms.ttl_ms(ttl_ms), fresh.envelope)
        with self._lock:
            if self._held.get(key) is held:
                if renewed:
                    self._held[key] = fresh
                else:  # expired, or taken by someone else meanwhile: no longer this worker's
                    del self._held[key]
        return renewed

    def _signed(self, key: str, token: bytes, ttl_ms: int) -> _Held:
        expiry_ms = int(self.clock() * 1e3) + self.lease_terms.ttl_ms(ttl_ms)
        return _Held(token, self.keyring.sign(key, LeaseValue(token, expiry_ms).pack()), expiry_ms)

    def _lease_token(self, key: str, envelope: bytes) -> bytes | None:
        """The holder's token in a lease read from the store, or None (counted, logged) when the
        lease is not to be honoured."""
        verified = self.keyring.verify(key, envelope)
        if isinstance(verified, VerifyFailure):
            self.stats.count("rejected_values", _REASONS[verified])
            _refused.warning("lease %s refused (%s); computing instead of waiting", key, verified.value)
            return None
        lease = LeaseValue.unpack(verified)
        fault = LeaseFault.MALFORMED if lease is None else self.lease_terms.judge(lease.expiry_ms,
                                                                                   int(self.clock() * 1e3))
        if fault is not None:
            self.stats.count("rejected_values", RejectReason.LEASE)
            _refused.warning("lease %s refused (%s%s); computing instead of waiting", key, fault.value,
                             "" if lease is None else f": signed to end {lease.expiry_ms - int(self.clock() * 1e3)} "
                                                      "ms from now by this worker's clock")
            return None
        return lease.token

    def error_kind(self, exc: Exception) -> str:
        return self.inner.error_kind(exc)

    def announce(self, channels: Sequence[str]) -> None:
        self.inner.announce(channels)

    def notices(self, on_notice: Callable[[str, bool], None]) -> Notices | None:
        return self.inner.notices(on_notice)

    def ping(self, connections: int = 1) -> None:
        self.inner.ping(connections)

    def close(self) -> None:
        self.inner.close()
