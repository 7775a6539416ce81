"""The sequences of a worker that hold a slot or wait for one, and how each one ends.

Shared by the ``Scheduler`` (which admits and plans) and the ``ModelRunner`` (which runs the
steps): a token goes out (``emit``), a sequence completes, fails or is freed, and its consumer is
woken on its own event loop (``deliver``). Everything here runs on the scheduler thread or under
``cond``, the one lock of the scheduler's state; ``cond`` is re-entrant (a ``threading.Condition``
over an ``RLock``), so a step holding it may end sequences.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from services.engine.fair_share import ClientShares
from services.engine.generation import FinishReason
from services.engine.logprobs import token_logprobs
from services.engine.sequence import Phase, Sequence
from services.engine.step_plan import SchedulerStats
from services.runtime.slots import Slot

MAX_HOLD_S = 0.25
"""A token held back by ``--stream-interval`` this long (seconds) wakes its consumer with the next
one: a stream stays well inside the router's one-second health-check timeout, which takes a
stream silent since a failed check for a frozen worker's (``services/route``)."""


class Lifecycle:
    """The active sequences, the queue, the counters, and every sequence's end.

    ``release`` frees a slot (the runner's bank); ``save_answer`` publishes what a sequence that
    ended normally computed, before its slot is freed (the KV connector's worker side); ``shares``
    counts each client's rows, every row counted until ``finish``."""

    def __init__(self, release: Callable[[Slot], None], save_answer: Callable[[Sequence], None],
                 shares: ClientShares) -> None:
        self._release = release
        self._save_answer = save_answer
        self.shares = shares
        self.cond = threading.Condition()
        self.queue: deque[list[Sequence]] = deque()
        """Groups of rows (one request each) waiting for slots, in arrival order."""
        self.active: list[Sequence] = []
        """Sequences holding a slot, in admission order."""
        self.stats = SchedulerStats()
        self._touched: dict[int, Sequence] = {}
        """Sequences with new output since the last ``deliver``."""

    @property
    def queued(self) -> int:
        """Sequences (rows) waiting for a slot."""
        return sum(len(rows) for rows in self.queue)

    def touch(self, seq: Sequence) -> None:
        """``seq`` has new output (or ended): its consumer is woken at the next ``deliver``."""
        self._touched[id(seq)] = seq

    def fetched(self, seq: Sequence) -> None:
        """``seq``'s fetch (its lookup, its waits, its encoder run) has ended: unless it ended
        meanwhile, it prefills from the next step on (any thread)."""
        with self.cond:
            if seq.phase is Phase.FETCHING:
                seq.phase = Phase.PREFILLING
            self.cond.notify()

    def finish(self, seq: Sequence) -> None:
        """Frees the sequence's slot and its place in its client's share (lock held or scheduler thread)."""
        if seq.phase is not Phase.FINISHED:
            self.shares.release(seq.client, 1)
        if seq.slot is not None:
            self._release(seq.slot)
            seq.slot = None
        if seq in self.active:
            self.active.remove(seq)
        seq.phase = Phase.FINISHED

    def complete(self, seq: Sequence) -> None:
        """``seq`` ended normally (EOS, stop token or string, length): its answer is published,
        then its slot freed."""
        self._save_answer(seq)
        with self.cond:
            self.stats.finished += 1
            self.finish(seq)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """Ends ``seq`` with ``exc`` for its consumer (lock held); the caller wakes the consumer.
        Rows that depend on it end too: followers still queued or waiting for its prompt, and every
        beam (beams only advance together)."""
        if seq.done:
            return
        self.stats.failed += 1
        if seq.phase is Phase.QUEUED and seq.rows in self.queue:
            self.queue.remove(seq.rows)
        self.finish(seq)
        seq.outbox.append(exc)
        group = seq.group
        if group is not None:
            for row in group.rows:
                if row.phase in (Phase.QUEUED, Phase.WAITING) or group.beams is not None:
                    self.fail(row, exc)
                    self.touch(row)

    def fail_all(self, seqs: list[Sequence], exc: BaseException) -> None:
        with self.cond:
            for seq in seqs:
                self.fail(seq, exc)
                self.touch(seq)

    def emit(self, seq: Sequence, token: int, logits: np.ndarray) -> None:
        """Sends ``token`` (picked from the raw ``logits``) to the consumer, and ends the sequence
        on a stop token or its length."""
        seq.generated += 1
        seq.tokens.append(token)
        now = time.perf_counter()
        seq.token_times.append(now)
        if seq.generated == 1:
            seq.timings.time_to_first_token_ms = (now - seq.t0) * 1e3
        if seq.return_logits:
            seq.logits.append(logits.copy())
        if seq.adjust is not None:
            seq.adjust.observe(token)
        reason = seq.ended_by(token)
        if reason is None and seq.generated >= seq.max_new_tokens:
            reason = FinishReason.LENGTH
        logprob = token_logprobs(logits[None], [token], seq.top_logprobs)[0] if seq.logprobs else None
        seq.outbox.append((token, reason, logprob))
        if seq.held_since is None:
            seq.held_since = now
        if (reason is not None or seq.generated == 1 or len(seq.outbox) >= seq.stream_interval
                or now - seq.held_since >= MAX_HOLD_S):
            seq.held_since = None
            self.touch(seq)
        if reason is None:
            seq.next_token = token
            seq.phase = Phase.DECODING
            self.set_paused(seq, self.unread_full(seq))
            return
        self.complete(seq)

    def deliver(self) -> None:
        """Wakes the consumers of every sequence with new output: one call per event loop."""
        touched, self._touched = list(self._touched.values()), {}
        wake_consumers(touched)

    @staticmethod
    def unread_full(seq: Sequence) -> bool:
        """Whether the consumer has ``seq.unread_limit`` tokens still to read (the sequence pauses)."""
        return len(seq.outbox) >= seq.unread_limit

    @staticmethod
    def set_paused(seq: Sequence, paused: bool) -> None:
        if paused and not seq.paused:
            seq.paused_since = time.monotonic()
        seq.paused = paused


def _set_ready(seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.ready.set()


def wake_consumers(seqs: list[Sequence]) -> None:
    """Sets each sequence's ``ready`` event on its own event loop: one call per loop, since each
    call_soon_threadsafe writes to that loop's wake-up pipe."""
    by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[Sequence]]] = {}
    for seq in seqs:
        by_loop.setdefault(id(seq.loop), (seq.loop, []))[1].append(seq)
    for loop, group in by_loop.values():
        try:
            loop.call_soon_threadsafe(_set_ready, group)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            pass
