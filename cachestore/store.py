"""The store interface: byte values under string keys, batched, with loop defaults.

A store knows nothing of tensors, models or gRPC. Writes are set-if-absent: a key, once written,
names one value until it expires or is evicted, so two replicas publishing the same block at once
store it once. Every method may raise; ``ResilientStore`` turns failures into misses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence

from cachestore.budget import StallBudget

MAX_LEASE_BYTES = 1024
"""The longest lease value a store reads: a holder's token (a worker id and a row number), its
expiry and a signing envelope take about 150 bytes; a longer one was written by someone else."""

ERROR_KINDS = ("timeout", "connection", "tls", "auth", "out_of_memory", "response", "protocol", "error")
"""Every label ``KVStore.error_kind`` may return (metrics show each from the start)."""


class StoreReplyError(Exception):
    """The store answered something that is not a value (a hostile or broken server): a failure
    like any other, never passed on."""


class Notices(ABC):
    """A subscription to ``KVStore.announce``: ``on_notice(channel, announced)`` is called, on a
    thread of the subscription's own, for each announcement on a channel listened to
    (``announced`` True), and when the subscription to one was confirmed or lost (False: what was
    announced meanwhile was missed). Announcements may be lost and may be forged by whoever can
    write to the store: a listener treats each call as a hint to look again, never as news of
    what it will find, and still looks now and then without one."""

    @abstractmethod
    def listen(self, channels: Collection[str]) -> None:
        """The channels whose announcements are wanted from now on (in place of the earlier ones)."""

    @property
    @abstractmethod
    def live(self) -> bool:
        """Whether announcements on every channel listened to are being delivered now (each
        subscription confirmed); while False, a listener looks as often as without one."""

    @abstractmethod
    def close(self) -> None:
        """Stops the subscription; no call of ``on_notice`` starts after this returns."""


class KVStore(ABC):
    """Abstract byte store. Batched methods loop over the single ones unless a backend overrides
    them with something better (pipelines).

    Reads are bounded: a reader that knows how long a value can be (a prefix block's exact size
    from the model's geometry, a lease's ``MAX_LEASE_BYTES``) passes that ``limit`` in bytes, and
    a value longer than it (or than the store's own bound) reads as a miss. A networked store
    never transfers such a value whole: it reads at most ``limit + 1`` bytes of it, and deletes
    it (counted as ``oversized``), as a value that fails verification is deleted. Values are
    never empty (an empty one reads as a miss too)."""

    name: str = "store"
    authenticated: bool = False
    """Every value this store returns was verified by a MAC over its bytes (so a checksum over the
    same bytes would add nothing)."""

    @abstractmethod
    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The value under ``key``, or None: also when it is longer than ``limit`` bytes."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> bool:
        """Writes ``value`` unless ``key`` exists (atomic, one command); True if written."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Removes ``keys`` (absent ones are ignored)."""

    def get_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> list[bytes | None]:
        """The values under ``keys``; ``limits``: each one's longest acceptable length in bytes."""
        return [self.get(k, limit) for k, limit in zip(keys, limits or [None] * len(keys), strict=True)]

    def iter_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> Iterator[bytes | None]:
        """The values under ``keys`` in order (``limits`` as in ``get_many``), each yielded as soon as it is read, so that a caller
        can use and drop one before the next arrives: a fetch then holds one value at a time, and
        works on each while the rest are still on their way. The iterator may end early (the rest
        count as missing: the store failed) and may be closed early by the caller."""
        yield from self.get_many(keys, limits)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Set-if-absent for each item; returns how many were written."""
        return sum(self.put(k, v) for k, v in items)

    def claim(self, key: str, token: bytes, ttl_ms: int) -> bytes | None:
        """A lease: writes ``token`` under ``key`` unless the key exists, to expire after ``ttl_ms``
        milliseconds; returns the holder's token (``token`` itself when this call took the lease),
        or None when nobody can be said to hold it (the caller goes ahead). A store shared by no
        one else keeps no leases: the caller always holds them."""
        return token

    def holder(self, key: str) -> bytes | None:
        """The token of the lease under ``key``, or None when none is held (expired, released)."""
        return None

    def release(self, key: str, token: bytes) -> None:  # noqa: B027 - optional: only shared stores keep leases
        """Ends the lease under ``key`` if ``token`` still holds it (a lease that expired and was
        taken by someone else is left alone)."""

    def renew(self, key: str, token: bytes, ttl_ms: int, replacement: bytes | None = None) -> bool:
        """Makes the lease under ``key`` expire ``ttl_ms`` milliseconds from now, if ``token``
        still holds it, holding ``replacement`` from then on when one is given (a signed lease
        carries its expiry: ``SignedStore`` signs a fresh one); True when it did. A holder that
        keeps making progress keeps its lease. A store shared by no one keeps no leases: True."""
        return True

    def announce(self, channels: Sequence[str]) -> None:  # noqa: B027 - optional: only shared stores have listeners
        """Tells whoever listens on ``channels`` (``notices``) that something changed, such as a
        lease holder's blocks published or its leases ended. At most once, and may be lost."""

    def notices(self, on_notice: Callable[[str, bool], None]) -> Notices | None:
        """A subscription to announcements, idle until it is given keys; None when this store
        cannot deliver them (a listener looks for changes itself)."""
        return None

    def stall_budget(self) -> StallBudget | None:
        """A fresh budget for one request's calls to this store (``cachestore.budget``): what their
        waits on a store that does not answer may add up to, used by the thread making them
        inside ``budget.spending``. None: this store never waits on anything (memory). A store
        that wraps another (``inner``: a ``ResilientStore``, a ``SignedStore``) gives the inner one's."""
        inner = getattr(self, "inner", None)
        return inner.stall_budget() if isinstance(inner, KVStore) else None

    def error_kind(self, exc: Exception) -> str:
        """A short label for a failure this store raised: one of ``ERROR_KINDS``."""
        return "error"

    def ping(self, connections: int = 1) -> None:
        """Raises when the store cannot be reached. A networked store opens and checks up to
        ``connections`` pooled connections at once, so that the first requests after a start
        find them open (a stateless worker's first warm fetch should cost what later ones do)."""
        self.get("kvshare:ping")

    def close(self) -> None:  # noqa: B027 - optional: only networked stores hold something to release
        """Releases connections."""
