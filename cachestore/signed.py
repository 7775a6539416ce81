"""A store whose values are signed on the way in and verified on the way out.

It sits directly on the shared tier (below a worker's L1), so a value that does not verify never
reaches the L1, the codec or the model. Such a value is a miss: counted by reason
(``unsigned``/``signature``), logged once per burst, and deleted, so the worker's next publish of
that block (set-if-absent) replaces it with a signed one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from cachestore.codec import RejectReason
from cachestore.ratelimit import RateLimitedLog
from cachestore.signing import Keyring, VerifyFailure
from cachestore.stats import CacheStats
from cachestore.store import KVStore, Notices

log = logging.getLogger(__name__)
_refused = RateLimitedLog(log)
_REASONS = {VerifyFailure.UNSIGNED: RejectReason.UNSIGNED, VerifyFailure.SIGNATURE: RejectReason.SIGNATURE}


class SignedStore(KVStore):
    authenticated = True

    def __init__(self, inner: KVStore, keyring: Keyring, stats: CacheStats) -> None:
        self.inner = inner
        self.keyring = keyring
        self.stats = stats
        self.name = f"signed({inner.name})"

    def get(self, key: str) -> memoryview | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[memoryview | None]:
        refused: list[str] = []
        values = [None if envelope is None else self._verified(key, envelope, refused)
                  for key, envelope in zip(keys, self.inner.get_many(keys), strict=True)]
        if refused:
            self.inner.delete(refused)
        return values

    def iter_many(self, keys: Sequence[str]) -> Iterator[memoryview | None]:
        refused: list[str] = []
        envelopes = zip(keys, self.inner.iter_many(keys), strict=False)
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
        """Leases are signed like values: a lease anyone could write would let them make every
        worker wait. A holder whose lease does not verify is nobody (the caller computes)."""
        envelope = self.keyring.sign(key, token)
        holder = self.inner.claim(key, envelope, ttl_ms)
        return None if holder is None else self._lease_token(key, holder)

    def holder(self, key: str) -> bytes | None:
        holder = self.inner.holder(key)
        return None if holder is None else self._lease_token(key, holder)

    def release(self, key: str, token: bytes) -> None:
        # HMAC signing is deterministic: the same token signs to the envelope stored.
        self.inner.release(key, self.keyring.sign(key, token))

    def renew(self, key: str, token: bytes, ttl_ms: int) -> None:
        self.inner.renew(key, self.keyring.sign(key, token), ttl_ms)

    def _lease_token(self, key: str, envelope: bytes) -> bytes | None:
        verified = self.keyring.verify(key, envelope)
        if isinstance(verified, VerifyFailure):
            self.stats.count("rejected_values", _REASONS[verified])
            _refused.warning("lease %s refused (%s); computing instead of waiting", key, verified.value)
            return None
        return bytes(verified)

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
