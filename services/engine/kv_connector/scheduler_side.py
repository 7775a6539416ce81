"""The KV connector's scheduler side: how many prompt tokens a sequence can get, from where, and
when. Three sources, each bounded by what computing would cost:

- the store: a lookup on a read thread (the longest cached run of blocks, copied into the slot as
  it arrives, and an encoder input's cross K/V, computed on the encoder thread on a miss);
- another worker computing the same blocks: the fleet's lease (``services.engine.leases``); the
  row waits on the waits' thread (``services.engine.run_waits``) and, after giving up, follows
  the holder on a ``Trail``;
- another row of this worker holding the same prefix (``in_worker``): copied, or waited for.

Every store call a row makes for its prompt (the fetch's, its waits' and its trail's) is within
the row's ``StallBudget`` (``cachestore.budget``): on a store that does not answer they wait
2 x the op timeout in all, at most, and the row computes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from cachestore.budget import spending
from cachestore.cross import CrossStore
from cachestore.keys import lease_key, progress_channel
from cachestore.prefix import PrefixLookup, PrefixStore
from cachestore.prefix import Receiver as BlockReceiver
from cachestore.stats import CacheStats
from cachestore.store import KVStore
from services.engine.kv_connector import in_worker
from services.engine.kv_connector.encoder_runs import Encode, EncoderRuns
from services.engine.kv_connector.fetch_policy import FetchPolicy, LookupClock
from services.engine.kv_connector.publish_queue import PublishQueue, after
from services.engine.kv_connector.state import Ahead, SequenceKV, Trail, cached_tokens
from services.engine.leases import Claim, HeldLeases, Tokens
from services.engine.run_waits import (
    MIN_STALL_MS,
    LeaseOptions,
    PrefillPace,
    RunWait,
    RunWaits,
    WaitEnd,
)
from services.engine.sequence import Sequence
from services.engine.step_plan import SchedulerStats, StepPlan

log = logging.getLogger(__name__)
LEASE_SLACK_MS = 500
"""A lease lives twice the holder's expected time to compute its run, plus this (ms), at most
``LeaseOptions.max_ttl_ms``."""
EARLY_WAIT_ENDS = frozenset({WaitEnd.STALLED, WaitEnd.SLOWER, WaitEnd.RELEASED})
"""Lease waits that end with blocks of the run missing, which this worker then computes itself."""

Receiver = BlockReceiver | None
"""Copies block i of a lookup into the row's slot as it arrives (``SlotBank.receiver``); None
where the slots cannot take blocks before the row's first step."""
R = TypeVar("R")


def within_budget(kv: SequenceKV, call: Callable[..., R]) -> Callable[..., R]:
    """``call``, its store calls made within the row's budget (on whichever thread it runs)."""
    def budgeted(*args):
        with spending(kv.store_budget):
            return call(*args)

    return budgeted


class KVConnectorScheduler:
    """Decides, per sequence, what comes from the store, another worker or another row. ``fetch``
    runs on a read thread, ``look_ahead``'s waits on the waits' thread, the rest on the scheduler
    thread (``plan_share`` and ``may_compute`` under the scheduler's lock)."""

    def __init__(self, prefix: PrefixStore, cross: CrossStore, cross_shape: tuple[int, int, int], store: KVStore,
                 cache_stats: CacheStats, leases: LeaseOptions, chunk_tokens: int, pace: PrefillPace,
                 waits: RunWaits, writes: PublishQueue, fetch_policy: FetchPolicy, encodes: EncoderRuns) -> None:
        self.prefix = prefix
        self.cross = cross
        self._cross_shape = cross_shape
        """(layers, cross heads, head size) of an encoder-decoder model's cross K/V."""
        self.store = store
        self.cache_stats = cache_stats
        self.leases = leases
        self.chunk_tokens = chunk_tokens
        """Prompt tokens prefilled per step (the scheduler's budget): one chunk."""
        self.pace = pace
        self.waits = waits
        self.writes = writes
        self.fetch_policy = fetch_policy
        """Whether a prompt's cached run is fetched or computed; fed by every lookup's timing."""
        self.encodes = encodes
        self.tokens = Tokens(uuid.uuid4().hex.encode())
        """Lease tokens: this worker, and which of its rows holds a lease."""
        self._lock = threading.Lock()
        self._awaiting: dict[str, tuple[Sequence, int]] = {}
        """Leases of other workers that a row of this one waits on, with that row and how many
        blocks it awaits (under ``_lock``)."""

    def fetch(self, seq: Sequence, receiver: Receiver, done: Callable[[], None], encode: Encode | None) -> bool:
        """On a read thread: the prompt's cached run of blocks, copied into the sequence's slot as
        they arrive where the slots allow it (``receiver``), and, for encoder-decoder models
        (``encode`` given), the encoder input's cross K/V: from the store unless the request skips
        reading, else computed by ``encode`` on the encoder thread (``EncoderRuns``) while the
        blocks are looked up. Sets ``seq.prefilled`` and its usage. Returns True when all of it
        is there; False when it goes on elsewhere (the encoder runs, or another worker holds the
        lease on the prompt's first missing blocks, which are waited for on the waits' thread):
        then ``done`` is called once every part has ended. A prompt whose run the fetch policy
        expects faster to compute than to fetch reads none of it and takes or waits on no lease
        (``SequenceKV.fetch_skipped``); the policy weighs the decoder prompt's blocks only (an
        encoder input's cross K/V is one value). Its store calls, here and in the waits it starts,
        are within the row's budget (``SequenceKV.store_budget``)."""
        kv = seq.kv
        if kv.store_budget is None:
            kv.store_budget = self.store.stall_budget()
        with spending(kv.store_budget):
            return self._fetch(seq, receiver, done, encode)

    def _fetch(self, seq: Sequence, receiver: Receiver, done: Callable[[], None], encode: Encode | None) -> bool:
        t = time.perf_counter()
        kv = seq.kv
        if encode is not None and not kv.cache.skip_read:
            kv.cross_kv = self.cross.get(kv.encoder_hash, *self._cross_shape, max_tokens=seq.encoder_input.shape[-1])
        if encode is None or kv.cross_kv is not None:
            return self._fetch_blocks(seq, receiver, done, t)
        encoding = self.encodes.start(seq, encode)

        def fetched() -> None:  # the blocks are there: done once the encoder's run has ended too
            encoding.add_done_callback(lambda _: done())

        if self._fetch_blocks(seq, receiver, fetched, t):
            fetched()
        return False

    def _fetch_blocks(self, seq: Sequence, receiver: Receiver, done: Callable[[], None], t: float) -> bool:
        """The prompt's blocks (``fetch``), from ``t`` (perf_counter) on: True when the lookup is
        complete, False when it waits for another worker's blocks and calls ``done`` at the end."""
        kv = seq.kv
        kv.fetch_skipped = not kv.cache.skip_read and not self.fetch_policy.fetches(len(seq.prompt))
        if kv.fetch_skipped:
            self.cache_stats.add(fetches_skipped=1)
        if kv.cache.skip_read or kv.fetch_skipped:
            kv.lookup = PrefixLookup(hashes=self.prefix.hashes(kv.namespace, seq.prompt), blocks=[])
        else:
            clock = LookupClock(receiver)
            kv.lookup = self.prefix.lookup(kv.namespace, seq.prompt, clock.into)
            self.fetch_policy.observe(clock, kv.lookup.hit_blocks)
        claim, holder, key = self._claim(seq, receiver)
        # A row of this worker that has already published part of the prompt may finish, freeing
        # the slot this row would copy from, before this row's first step: then its blocks are
        # waited for in the store, as another worker's are, not computed again.
        if not (claim is Claim.OTHER_WORKER or (claim is Claim.SIBLING and kv.lookup.hit_blocks > 0)):
            self._fetched(seq, t, receiver)
            return True
        run = len(kv.lookup.hashes) - kv.lookup.hit_blocks  # blocks awaited
        factor, size = self.leases.wait_factor, kv.namespace.block_size
        # Before the first blocks, no floor: a lease that nobody honours (forged, replayed, its holder
        # dead) costs the wait factor times computing the run here, however cheap the run (or one
        # poll: a wait's second look comes a poll after its first).
        first_stall_ms = factor * self.pace.expected_ms(run * size)
        with self._lock:
            # One store wait per lease and worker when it covers this row's: the worker's other
            # rows wait for that row's blocks and copy them from it (``in_worker.plan_share``).
            # A row missing fewer blocks waits for its own, not for the other row's longer run.
            if key in self._awaiting and run >= self._awaiting[key][1]:
                self._fetched(seq, t, receiver)
                return True
            own = key not in self._awaiting
            if own:
                self._awaiting[key] = (seq, run)
                kv.awaiting = True
        stall_ms = max(MIN_STALL_MS, factor * self.pace.expected_ms(min(3 * self.chunk_tokens, run * size)))

        def end(outcome: WaitEnd) -> None:
            self.cache_stats.count("lease_waits", outcome.value)
            if outcome in (WaitEnd.STALLED, WaitEnd.SLOWER):  # the holder may still publish ahead of this row
                kv.trail = Trail(key, holder, delivered=wait.received > 0)
            # A wait given up on (the holder stalled, looked slower than computing, or let go early)
            # means computing what another worker computes too: worth a line at the default level.
            # Complete and cancelled waits are not, and a failed poll has logged its exception.
            level = logging.INFO if outcome in EARLY_WAIT_ENDS else logging.DEBUG
            log.log(level, "request %s: waited %.0f ms for another worker's %d blocks: %s, %d arrived%s",
                    seq.request_id, (time.perf_counter() - t) * 1e3, run, outcome.value, kv.lookup.hit_blocks,
                    f" ({wait.detail})" if wait.detail else "")
            self._fetched(seq, t, receiver)
            if own:
                with self._lock:
                    del self._awaiting[key]
            done()

        self.cache_stats.add(blocks_awaited=run)
        wait = RunWait(
            fetch_more=within_budget(kv, lambda: self._fetch_more(kv.lookup, size, receiver)),
            missing=lambda: len(kv.lookup.hashes) - kv.lookup.hit_blocks,
            held=within_budget(kv, lambda: self.store.holder(key) == holder),
            cancelled=lambda: seq.aborted or seq.done,
            compute_s=lambda blocks: factor * self.pace.expected_ms(blocks * size) / 1e3,
            stall_s=stall_ms / 1e3,
            first_stall_s=first_stall_ms / 1e3,
            pace_blocks=-(-2 * self.chunk_tokens // size),
            on_end=within_budget(kv, end),
            channel=progress_channel(holder),
        )
        self.waits.add(wait)
        return False

    def look_ahead(self, seq: Sequence) -> Future:
        """For a row on a ``Trail``, between two chunks: waits on the waits' thread for the blocks
        from the row's next one on, until the next chunk's blocks are all there, the holder lets go
        of its lease, or nothing came for as long as computing that chunk would take the row now
        (wait factor included, at what its latest chunk cost; at least two polls); while the holder
        has published none of the blocks waited for, it only reads what the store holds. The future
        holds an ``Ahead`` (kept up: the whole chunk came, and no later than computing what came
        would have taken), or None when nothing came; it never fails (a store error brings
        nothing) and may be done already."""
        result: Future = Future()
        kv = seq.kv
        size, start = kv.namespace.block_size, seq.prefilled
        hashes = kv.lookup.hashes
        if kv.cache.skip_read or start % size or start // size >= len(hashes):
            result.set_result(None)
            return result
        found = PrefixLookup(hashes=hashes, blocks=[], hit_blocks=start // size)
        trail, leases = kv.trail, self.leases
        ms_per_token = trail.ms_per_token or self.pace.ms_per_token
        chunk_blocks = -(-self.chunk_tokens // size)
        wanted = min(found.hit_blocks + chunk_blocks, len(hashes))
        bound_s = max(2 * leases.poll_ms, leases.wait_factor * ms_per_token * chunk_blocks * size) / 1e3
        began = time.monotonic()
        trail.give_up_at = began + 2 * bound_s
        # A holder that has published none of the blocks waited for gets a look at what the store
        # holds now, not a wait (``Trail.delivered``): a forged lease costs one read per chunk here.
        look_s = bound_s if trail.delivered else 0.0

        def end(outcome: WaitEnd) -> None:
            self.prefix.complete_windows(found, size, len(seq.prompt), first=start // size)
            tokens = cached_tokens(found.hit_blocks, size, len(seq.prompt))
            if tokens <= start:
                result.set_result(None)
                return
            in_time = time.monotonic() - began <= leases.wait_factor * ms_per_token * (tokens - start) / 1e3
            result.set_result(Ahead(start, found.blocks, tokens, outcome is WaitEnd.COMPLETE and in_time,
                                    found.windows))

        self.waits.add(RunWait(
            fetch_more=within_budget(kv, lambda: self._fetch_more(found, size, None)),
            missing=lambda: max(0, wanted - found.hit_blocks),
            held=within_budget(kv, lambda: self.store.holder(trail.key) == trail.holder),
            cancelled=lambda: seq.aborted or seq.done,
            compute_s=lambda blocks: leases.wait_factor * ms_per_token * blocks * size / 1e3,
            stall_s=look_s,
            first_stall_s=look_s,
            pace_blocks=chunk_blocks,
            on_end=within_budget(kv, end),
            channel=progress_channel(trail.holder),
        ))
        return result

    def plan_share(self, seq: Sequence, active: list[Sequence], plan: StepPlan, stats: SchedulerStats) -> int | None:
        """In-worker single-flight (``in_worker.plan_share``): the prompt tokens ``seq`` holds once
        this step's copies from other rows are done, or None: it sits this step out."""
        return in_worker.plan_share(seq, active, plan, stats)

    def may_compute(self, seq: Sequence, plan: StepPlan, wake: Callable[[], None]) -> bool:
        """Whether ``seq`` may compute its next chunk this step as far as another worker is
        concerned (lock held): always, unless it follows a holder on a ``Trail`` and has not yet
        looked for that holder's blocks since its last chunk (``in_worker.looked``); ``wake``
        tells the scheduler when a look it started ends."""
        if seq.kv.trail is None:
            return True
        return in_worker.looked(seq, plan, lambda: self.look_ahead(seq), wake)

    def request_finished(self, rows: list[Sequence]) -> None:
        """Ends the leases ``rows`` still hold (a prompt cancelled, failed or distrusted before its
        end), after their publishes in flight, off the token path, so that workers waiting on them
        compute at once."""
        release_leases(rows, self.writes)

    def _fetch_more(self, found: PrefixLookup, block_size: int, receiver: Receiver) -> int:
        """One poll of a wait: the next missing block alone (most polls find nothing: one GET, not
        one per missing block), then, once it came, every block that follows it."""
        arrived = self.prefix.extend(found, block_size, receiver, limit=1)
        if arrived:
            arrived += self.prefix.extend(found, block_size, receiver)
        self.cache_stats.add(blocks_received=arrived)
        return arrived

    def _claim(self, seq: Sequence, receiver: Receiver) -> tuple[Claim, bytes | None, str | None]:
        """The fleet's single-flight (``services.engine.leases``): when the prompt has uncached
        full blocks, takes the lease on computing them (then ``seq.kv.lease`` holds it), or finds
        who holds it. Returns what the claim found, the holder's token and the lease's key.

        A lease found free may have been released just now by a holder that finished the prompt
        after this sequence's lookup read the store: that holder stored every block before its
        release, so the lookup reads on once before this sequence computes them again."""
        kv = seq.kv
        hashes, size = kv.lookup.hashes, kv.namespace.block_size
        if not self.leases.enabled or kv.cache.skip_read or not kv.publishes_prompt:
            return Claim.NONE, None, None
        while kv.lookup.hit_blocks < len(hashes):
            hit = kv.lookup.hit_blocks
            key, token = lease_key(hashes[hit]), self.tokens.new()
            ttl_ms = min(int(2 * self.pace.expected_ms((len(hashes) - hit) * size) + LEASE_SLACK_MS),
                         self.leases.max_ttl_ms)
            holder = self.store.claim(key, token, ttl_ms)
            claim = self.tokens.classify(holder, token)
            if claim is Claim.HELD and self.prefix.extend(kv.lookup, size, receiver):
                self.store.release(key, token)
                continue
            if claim is Claim.HELD:
                kv.lease = HeldLeases(self.store, token, ttl_ms, [key])
                if seq.aborted or seq.done:  # the request ended while the claim was on its way
                    self.request_finished([seq])
            return claim, holder, key
        return Claim.NONE, None, None

    def _fetched(self, seq: Sequence, t0: float, receiver: Receiver) -> None:
        """The lookup's end (its run is final: no wait extends it): with windowed layers their K/V
        that a continuation reads is fetched too, which may shorten the run; then what it found
        becomes the sequence's cached prompt."""
        kv = seq.kv
        size = kv.namespace.block_size
        lookup = kv.lookup
        if lookup.hit_blocks:
            self.prefix.complete_windows(lookup, size, len(seq.prompt), receiver)
            kv.window_floor = self.prefix.geometry.window_floor(lookup.window_from, size)
        seq.usage.encoder_cache_hit = kv.cross_kv is not None
        seq.prefilled = seq.usage.cached_prompt_tokens = cached_tokens(lookup.hit_blocks, size, len(seq.prompt))
        kv.published_blocks = lookup.hit_blocks
        seq.timings.cache_fetch_ms = (time.perf_counter() - t0) * 1e3


def release_leases(rows: list[Sequence], writes: PublishQueue) -> None:
    """Ends the leases ``rows`` still hold, each after its row's publishes in flight, on the write
    threads. Never dropped, however many writes wait: a lease left behind holds waiters back."""
    for seq in rows:
        kv = seq.kv
        lease, kv.lease = kv.lease, None
        if lease is not None:
            earlier = kv.publishing
            writes.always(0, lambda lease=lease, earlier=earlier: (after(earlier), lease.end()))
