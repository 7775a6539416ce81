"""The leases one sequence holds on computing a prompt's uncached blocks (fleet single-flight).

A sequence takes the lease on its prompt's first missing block when its lookup ends, and, before
each chunk of blocks it publishes, the lease on the block after that chunk: a worker that arrives
while the prompt is half computed finds its first missing block leased too, and waits instead of
computing the rest again. Each of those chunks also renews the leases already held, so a lease
lives ``ttl_ms`` past the holder's latest chunk, not past its first: a holder slowed by a busy
machine keeps its lease while it makes progress, and one that died loses it after ``ttl_ms``. Every
lease is written under the sequence's own token (the worker's token and a row number), so that one
row's end never ends a lease another row of the same worker holds. ``end`` releases them all
(compare-and-delete); a lease never released expires. After each chunk and after the end, the
holder announces on its token's channel (``KVStore.announce``, ``keys.progress_channel``), so that
waiters on any of its leases look then rather than polling in between. A lease lives at most
``LeaseOptions.max_ttl_ms`` (``--lease-max-ttl-ms``) past the latest chunk.

Anyone who can write to Redis can write a lease, so a lease is never trusted beyond a bounded wait:

- signed (``--cache-signing-key-file``; ``SignedStore``): the lease's value is its token and its
  expiry (epoch ms), under the MAC (``cachestore.lease_terms``). The token names the worker
  process (fresh per start) and a row number never reused, so no two claims sign the same value;
  each renewal signs a fresh expiry and replaces the value the holder wrote last (compare-and-set).
  A waiter honours a lease only while its signed expiry lies between now minus the clock skew and
  now plus the longest lease plus the skew (``--lease-clock-skew-ms``, default 1 s): a lease
  copied while its holder computed and written back later (with any ``PX``) is refused, deleted
  and claimed by the reader, which computes at once; a copy written back at once holds a waiter
  no longer than what remained of it, and no longer than the unsigned bound below.
- unsigned: a forged lease holds a waiter for at most ``--lease-wait-factor`` (default 2) times
  the waiter's own expected prefill of the run (``run_waits``: its measured pace; no floor), after
  which it computes, and its later looks for the "holder's" blocks only read the store (``Trail``).
  A wait looks at most once a ``--lease-poll-ms``, so the wait is at least one poll. So a forged
  lease costs at most about (1 + wait factor) times a cold prefill, 3x by default, or a poll for
  a cheaper prompt (``bench/attack_leases.py``, tiny model: 709-token prompts 11.3 -> 33.5 ms,
  3.0x, and 101-token ones 2.4 -> 12.8 ms; before, 13x and 34x, when a 100 ms floor bounded the
  first wait from below and the trail waited twice more).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from enum import Enum

from cachestore.keys import progress_channel
from cachestore.store import KVStore


class Claim(Enum):
    HELD = "held"
    """This row took the lease: it computes the run and publishes it."""
    SIBLING = "sibling"
    """Another row of this worker holds it: the rows share in the worker (``Scheduler._plan_share``)."""
    OTHER_WORKER = "other_worker"
    """Another worker holds it: wait for its blocks (``run_waits``)."""
    NONE = "none"
    """Nobody can be said to hold it (leases off, or the store failed): compute."""


class Tokens:
    """Lease tokens of one worker process: ``<worker>.<row>``, the worker part fresh per process
    so that a restarted worker never mistakes its predecessor's leases for its own."""

    def __init__(self, worker: bytes) -> None:
        self.worker = worker
        self._rows = itertools.count()

    def new(self) -> bytes:
        return b"%s.%d" % (self.worker, next(self._rows))

    def classify(self, holder: bytes | None, token: bytes) -> Claim:
        if holder is None:
            return Claim.NONE
        if holder == token:
            return Claim.HELD
        if holder.startswith(self.worker + b"."):
            return Claim.SIBLING
        return Claim.OTHER_WORKER


@dataclass(eq=False)
class HeldLeases:
    """The leases one sequence holds. ``extend`` and ``end`` run on the write threads, in the
    order of the sequence's publishes; ``end`` may also come from the request's end."""

    store: KVStore
    token: bytes
    ttl_ms: int
    keys: list[str]
    """Held now."""
    _ended: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def extend(self, key: str) -> None:
        """Renews the leases held, and takes the lease on ``key`` as well, unless the leases ended
        or someone holds it."""
        with self._lock:
            if self._ended:
                return
            held = list(self.keys)
        for old in held:
            self.store.renew(old, self.token, self.ttl_ms)
        if self.store.claim(key, self.token, self.ttl_ms) == self.token:
            with self._lock:
                self.keys.append(key)
                ended = self._ended
            if ended:  # ended while claiming: nobody else will release it, nor tell its waiters
                self.store.release(key, self.token)
                self.announce()

    def announce(self) -> None:
        """Tells the waiters on these leases to look (blocks were published, or the leases ended),
        on the holder's channel: one announcement whatever the number of keys held."""
        channel = progress_channel(self.token)
        if channel is not None:
            self.store.announce([channel])

    def end(self) -> None:
        with self._lock:
            keys, self.keys, ended, self._ended = self.keys, [], self._ended, True
        for key in keys:
            self.store.release(key, self.token)
        if not ended:
            self.announce()
