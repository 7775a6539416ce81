"""Fleet-wide single-flight: waiting for the blocks another worker is computing, never for long.

Before a worker computes a run of uncached prefix blocks, it takes a lease on the run's first
block in the store (``KVStore.claim``, set-if-absent with an expiry). A worker that finds the lease
held by another worker does not compute: its sequence waits here while the holder publishes the
run chunk by chunk, and each block is copied into the waiting slot as soon as it is in the store.
The wait ends, and the sequence computes whatever it still lacks, at the first of:

- every block of the run has arrived (the common case: nothing computed twice);
- the lease is gone with blocks still missing (the holder finished a shorter prompt, or failed);
- no block arrived for ``stall`` (the holder died, or is too busy to be worth waiting for): three
  chunks' worth of this worker's prefill time between arrivals (at least ``MIN_STALL_MS``), and,
  for the first ones, the time it would take to compute the whole run, with no floor: a lease
  that nobody honours (forged, replayed, its holder dead) costs ``wait_factor`` times computing
  the run, however cheap the run (but a wait is stepped at most once a poll: at least one poll);
- waiting has become slower than computing: at the pace the holder's blocks have arrived since
  the first of them (judged once as long has passed as computing two chunks would take), the
  missing ones would take longer than this worker computing them now, from its own measured
  prefill pace (``PrefillPace``) times ``LeaseOptions.wait_factor``.

So a wait lasts about as long as computing would have at most, and a store that is slow, down or
hostile (a forged lease: see ``services.engine.leases``) costs at most the stall bound, never a
wrong token. One thread polls every waiting sequence; no read thread is held by a wait. Where the store
announces the holder's chunks (Redis pub/sub), a waiter looks when one is announced, and
otherwise only every ``IDLE_POLLS`` polls or when one of the bounds above falls due: a waiting
worker sent Redis 187 commands a second polling every 10 ms, 40 with announcements.

Each wait's store calls spend its row's budget (``cachestore.budget``); one pass over the waits
due spends a budget of its own as well, so that rows stepped one after another on this thread
wait on a store that does not answer 2 x the op timeout in all per pass, not that much each.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from cachestore.budget import StallBudget, spending
from cachestore.store import Notices

log = logging.getLogger(__name__)

IDLE_POLLS = 5
"""While the store announces the holder's chunks, a wait with no announcement is still stepped this
many polls apart (and when a bound falls due): it notices an announcement lost a little later."""

MIN_PACE_TOKENS = 32
"""Prefill chunks shorter than this do not move the measured pace: a chunk of a few tokens costs
its fixed overhead, not its tokens."""

MIN_STALL_MS = 100.0
"""The shortest stall a wait tolerates (ms): a publish takes a round trip or two, even when the
holder's chunks are quick."""


@dataclass(frozen=True, slots=True)
class LeaseOptions:
    wait_factor: float = 2.0
    """A waiter computes the missing blocks itself once waiting for them looks slower than this
    many times its own expected time to compute them; 0 turns leases off (every worker computes
    what it lacks). Not 1: a holder as fast as the waiter makes the two estimates equal, so noise
    would decide, and a waiter that computes on CPUs it shares with the holder slows both (a
    burst over replicas on one machine computed the prefix 1.75x fleet-wide at 1)."""
    poll_ms: float = 10.0
    """How often a waiter looks for newly published blocks (ms); while the store announces them,
    when one is announced and ``IDLE_POLLS`` times this apart otherwise."""
    first_ms_per_token: float = 1.0
    """The prefill pace assumed until the worker has measured its own (ms per prompt token)."""
    max_ttl_ms: int = 60_000
    """The longest a lease this worker takes lives past its latest chunk (``LeaseTerms.max_ttl_ms``:
    a signed lease signed to end further ahead is refused by the others)."""

    @property
    def enabled(self) -> bool:
        return self.wait_factor > 0


RECENT_WEIGHT = 0.2
"""The weight of each new observation in a running estimate (``running_mean``)."""


def running_mean(mean: float, value: float, observations: int) -> float:
    """An exponentially weighted mean after ``value``, the ``observations + 1``-th: the first
    observation replaces whatever ``mean`` assumed, each later one moves it by ``RECENT_WEIGHT``."""
    return value if not observations else mean + RECENT_WEIGHT * (value - mean)


class PrefillPace:
    """This worker's recent prefill cost in ms per prompt token: a running mean over prefill
    chunks (the scheduler thread observes; any thread reads)."""

    def __init__(self, first_ms_per_token: float) -> None:
        self.ms_per_token = first_ms_per_token
        self.observations = 0
        """Chunks measured so far (0: ``ms_per_token`` is still the assumed first pace)."""

    def observe(self, tokens: int, ms: float) -> None:
        if tokens <= 0:
            return
        self.ms_per_token = running_mean(self.ms_per_token, ms / tokens, self.observations)
        self.observations += 1

    def expected_ms(self, tokens: int) -> float:
        return tokens * self.ms_per_token


class WaitEnd(Enum):
    COMPLETE = "complete"
    RELEASED = "released"
    STALLED = "stalled"
    SLOWER = "slower"
    CANCELLED = "cancelled"
    FAILED = "failed"
    """Polling failed unexpectedly (a bug): the sequence computes."""


@dataclass(eq=False, slots=True)
class RunWait:
    """One sequence waiting for a run of blocks another worker holds the lease on."""

    fetch_more: Callable[[], int]
    """Reads blocks published since, into the waiting slot; returns how many arrived."""
    missing: Callable[[], int]
    """Blocks of the run still missing."""
    held: Callable[[], bool]
    """Whether the other worker still holds the lease."""
    cancelled: Callable[[], bool]
    """The request went away: stop waiting."""
    compute_s: Callable[[int], float]
    """Seconds this worker would take to compute that many missing blocks (wait factor included)."""
    stall_s: float
    """Longest gap between arrivals once blocks come."""
    first_stall_s: float
    """Longest wait for the first blocks: the holder computes a whole chunk before it publishes
    any, more slowly than usual when the burst that made it the holder loads its machine. For a
    lease wait, the wait factor times computing the whole run, with no floor: what a forged lease
    costs. 0 for a look that only reads (``Trail.delivered``)."""
    pace_blocks: int
    """The holder's pace is judged only once as long has passed since its first blocks as this
    worker would take to compute this many (two chunks' worth): one chunk's interval is mostly
    noise at a burst's start (a slow chunk made three of four waiters compute a prompt they had
    a quarter of, which slowed the holder more). Judging later than that would let a slow holder
    hold the wait longer than computing takes."""
    on_end: Callable[[WaitEnd], None]
    """Called once, on the polling thread, when the wait ends."""
    last_progress: float = field(default_factory=time.monotonic)
    received: int = 0
    first_arrival: float | None = None
    """time.monotonic() when the first blocks arrived: the holder's pace is measured from there
    (before, it may have been computing for a while, or just starting)."""
    first_batch: int = 0
    channel: str | None = None
    """Where the holder announces its progress (``keys.progress_channel``); None: polled only."""
    stepped_at: float | None = None
    """time.monotonic() of the latest step (None: not stepped yet)."""
    noticed: bool = False
    """An announcement came since the latest step."""
    detail: str = ""
    """Why a wait ended early, in numbers (ms), for the log."""

    def stalls_at(self) -> float:
        """When (time.monotonic()) the wait stalls unless a block arrives before."""
        return self.last_progress + (self.stall_s if self.first_arrival is not None else self.first_stall_s)

    def slower_at(self, missing: int) -> float:
        """When, unless a block arrives before, waiting for ``missing`` blocks at the holder's
        pace since its first ones becomes slower than computing them: never judged before
        computing ``pace_blocks`` would take, nor before a block came after the first ones."""
        since_first = self.received - self.first_batch
        if self.first_arrival is None or since_first <= 0 or missing <= 0:
            return math.inf
        return self.first_arrival + max(self.compute_s(self.pace_blocks), self.compute_s(missing) * since_first / missing)


class RunWaits:
    """The thread that steps every ``RunWait``: each ``poll_ms``, or, while the store announces
    on the channels waited on (``KVStore.notices``), when the holder announces a chunk and
    otherwise ``IDLE_POLLS`` polls apart or when a bound falls due (``_due_at``)."""

    def __init__(self, poll_ms: float, notices: Callable[[Callable[[str, bool], None]], Notices | None] | None = None,
                 pass_budget: Callable[[], StallBudget | None] = lambda: None) -> None:
        """``pass_budget``: a fresh budget for one pass over the waits due (``KVStore.stall_budget``)."""
        self._poll_s = poll_ms / 1e3
        self._pass_budget = pass_budget
        self._waits: list[RunWait] = []
        self._cond = threading.Condition()
        self._closed = False
        self.woken = 0
        """Waits an announcement woke (the metric shows whether holders' announcements arrive)."""
        self._notices = notices(self._noticed) if notices is not None else None
        self._thread = threading.Thread(target=self._run, name="kv-run-waits", daemon=True)
        self._thread.start()

    def add(self, wait: RunWait) -> None:
        with self._cond:
            if self._closed:
                end = WaitEnd.CANCELLED
            else:
                self._waits.append(wait)
                self._listen()
                self._cond.notify()
                return
        wait.on_end(end)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waits)

    def close(self) -> None:
        """Ends every wait (their sequences compute or are failed by the scheduler's close)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        if self._notices is not None:
            self._notices.close()

    def _listen(self) -> None:
        """(Lock held.) Listens to the channels of the waits there are now."""
        if self._notices is not None:
            self._notices.listen({wait.channel for wait in self._waits if wait.channel is not None})

    def _noticed(self, channel: str, announced: bool) -> None:
        with self._cond:
            woken = [wait for wait in self._waits if wait.channel == channel]
            for wait in woken:
                wait.noticed = True
            if woken:
                self.woken += len(woken) if announced else 0
                self._cond.notify()

    @property
    def live(self) -> bool:
        """Whether the store announces progress on every channel waited on now (False without
        announcements: waits poll every ``poll_ms``)."""
        return self._notices is not None and self._notices.live

    def _due_at(self, wait: RunWait, live: bool) -> float:
        """When ``wait`` is next stepped (time.monotonic()): at once when new; one poll after its
        latest step when announced (so a flood of announcements costs no more than polling) or
        while its channel is not live; else ``IDLE_POLLS`` polls after it, or when it would stall
        or turn slower than computing, if that comes first."""
        if wait.stepped_at is None:
            return 0.0
        soonest = wait.stepped_at + self._poll_s
        if wait.noticed or not live or wait.channel is None:
            return soonest
        bound = min(wait.stalls_at(), wait.slower_at(wait.missing()))
        return max(soonest, min(wait.stepped_at + self._poll_s * IDLE_POLLS, bound))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._waits:
                        self._cond.wait()
                        continue
                    now = time.monotonic()
                    live = self.live
                    due_at = min(self._due_at(wait, live) for wait in self._waits)
                    if due_at <= now:
                        break
                    self._cond.wait(due_at - now)
                if self._closed:
                    waits, self._waits = self._waits, []
                    break
                waits = [wait for wait in self._waits if self._due_at(wait, live) <= now]
                for wait in waits:
                    wait.noticed, wait.stepped_at = False, now
            with spending(self._pass_budget()):
                for wait in waits:
                    try:
                        end = self._step(wait)
                    except Exception:  # noqa: BLE001 - one wait's failure must not strand the others
                        log.exception("polling for another worker's blocks failed; computing instead")
                        end = WaitEnd.FAILED
                    if end is not None:
                        with self._cond:
                            self._waits.remove(wait)
                            self._listen()
                        self._end(wait, end)
        for wait in waits:
            self._end(wait, WaitEnd.CANCELLED)

    @staticmethod
    def _step(wait: RunWait) -> WaitEnd | None:
        if wait.cancelled():
            return WaitEnd.CANCELLED
        now = time.monotonic()
        arrived = wait.fetch_more()
        if arrived:
            wait.last_progress = now
            wait.received += arrived
            if wait.first_arrival is None:
                wait.first_arrival, wait.first_batch = now, arrived
        missing = wait.missing()
        if not missing:
            return WaitEnd.COMPLETE
        if now >= wait.stalls_at():
            bound = wait.stalls_at() - wait.last_progress
            wait.detail = f"nothing new for {(now - wait.last_progress) * 1e3:.0f} ms (bound {bound * 1e3:.0f})"
            return WaitEnd.STALLED
        if now >= wait.slower_at(missing):
            since_first, elapsed = wait.received - wait.first_batch, now - wait.first_arrival
            wait.detail = (f"{missing} missing blocks in {missing * elapsed / since_first * 1e3:.0f} ms at the holder's "
                           f"pace ({since_first} blocks in {elapsed * 1e3:.0f} ms) against "
                           f"{wait.compute_s(missing) * 1e3:.0f} ms computing them here, wait factor included")
            return WaitEnd.SLOWER
        if not wait.held():
            # The holder publishes its last blocks before it releases: one more read decides.
            wait.fetch_more()
            return WaitEnd.RELEASED if wait.missing() else WaitEnd.COMPLETE
        return None

    @staticmethod
    def _end(wait: RunWait, end: WaitEnd) -> None:
        try:
            wait.on_end(end)
        except Exception:  # noqa: BLE001 - one sequence's failure must not end the others' waits
            log.exception("ending a wait for another worker's blocks failed")
