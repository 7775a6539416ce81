"""The scheduler: admits a worker's sequences and plans each step; the ``ModelRunner`` runs it.

One thread runs the steps. Each step is decided by ``schedule()`` (a plain ``StepPlan``: which
sequences decode, which prefill chunks run, which prefixes are copied) and carried out by
``ModelRunner.execute``:

- every sequence that is decoding advances in *one* model run; a sequence joins that batch the
  step after its prefill ends and leaves the moment it finishes or is cancelled: nobody waits for
  a batch to drain;
- prefill chunks share one token budget per step (``max_prefill_tokens_per_step``), run after the
  decode, so the streams already decoding keep a bounded gap between tokens while long prompts
  arrive.

Admission is decided at the door, synchronously: a free slot is taken at once, else the request
waits in a queue of at most ``max_queued``; past that ``Overloaded`` is raised before any work is
done. The queue is served in order, except that a request needing more rows than are free lets
up to ``max_batch`` later ones that fit go first (``_admittable``). Store lookups run on the read
threads and encoder runs on the encoder thread (the KV connector's scheduler side), never on this
thread: a row is planned once its fetch has ended. The connector also says which rows copy their
prefix from another row or wait for another worker's blocks this step.

A request with n samples or beams is admitted as one group of rows, all at once or not at all.
Its leader fetches and prefills; when the prompt is done its K/V is copied into the followers'
rows and every row picks its first token from the same logits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.engine.lifecycle import wake_consumers
from services.engine.runner import ModelRunner
from services.engine.sequence import Phase, Sequence
from services.engine.step_plan import SchedulerStats, StepPlan
from services.errors import Overloaded

log = logging.getLogger(__name__)
IDLE_RECHECK_S = 0.05


@dataclass(frozen=True, slots=True)
class SchedulerOptions:
    max_batch: int = 0
    """Sequences holding a slot at once (fetching, prefilling or decoding): the decode batch's most
    rows. 0 lets the engine derive it from its K/V memory budget."""
    max_queued: int = 128
    """Admitted sequences waiting for a slot; one more is refused with ``Overloaded`` at once."""
    max_prefill_tokens_per_step: int = 256
    """Prompt tokens prefilled per step, across all prefilling sequences (bounds the gap between
    the tokens of the streams already decoding)."""
    max_unread_tokens: int = 256
    """A sequence whose consumer has this many tokens still to read sits out decode steps."""
    max_paused_s: float = 30.0
    """A sequence paused this long (its client stopped reading) is ended with ``Overloaded``,
    freeing its slot."""


class PrefixSources(Protocol):
    """What the scheduler asks of the KV connector's scheduler side (``KVConnectorScheduler``)."""

    def fetch(self, seq: Sequence, receiver: Callable | None, done: Callable[[], None],
              encode: Callable[[], np.ndarray] | None) -> bool:
        """On a read thread: the store lookup, and for encoder-decoder models the cross K/V
        (``encode`` runs the encoder on a miss, off this thread and the scheduler's). Returns True
        when it is complete; False when it goes on elsewhere (waiting for another worker's blocks,
        or for the encoder), then ``done`` is called once it is."""

    def plan_share(self, seq: Sequence, active: list[Sequence], plan: StepPlan, stats: SchedulerStats) -> int | None:
        """The prompt tokens ``seq`` holds once this step's copies from other rows are done, or
        None: it sits this step out, waiting for another row."""

    def may_compute(self, seq: Sequence, plan: StepPlan, wake: Callable[[], None]) -> bool:
        """Whether ``seq`` may compute its next chunk this step rather than wait for another
        worker's blocks."""


class Scheduler:
    def __init__(self, runner: ModelRunner, sources: PrefixSources, options: SchedulerOptions,
                 read_pool: Executor) -> None:
        self.runner = runner
        self.sources = sources
        self.options = options
        self.life = runner.lifecycle
        self._read_pool = read_pool
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-scheduler", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> SchedulerStats:
        return self.life.stats

    @property
    def running(self) -> int:
        return len(self.life.active)

    @property
    def active(self) -> list[Sequence]:
        """The sequences holding a slot now, in admission order (a snapshot)."""
        with self.life.cond:
            return list(self.life.active)

    @property
    def queued(self) -> int:
        """Sequences (rows) waiting for a slot."""
        return self.life.queued

    def submit(self, rows: list[Sequence]) -> None:
        """Admits one request's rows (one sequence, or a group) or raises ``Overloaded`` at once,
        naming what was full. ``len(rows)`` is at most ``max_batch`` (the engine checks)."""
        life = self.life
        with life.cond:
            if self._closed:
                raise Overloaded("the worker is shutting down; retry on another replica")
            place = self._place(len(rows))
            if place == "start":
                self._start(rows)
            elif place == "queue":
                life.queue.append(rows)
                self._admit()
            else:
                raise self._full()
            life.stats.admitted += 1

    def check_room(self, rows: int) -> None:
        """Raises ``Overloaded`` (counted) when ``rows`` more could neither start nor queue now: a
        request is refused before it is prepared. ``submit`` decides for good. A row count no
        request may have is left to validation, which says why."""
        if not 1 <= rows <= self.options.max_batch:
            return
        with self.life.cond:
            if self._place(rows) is None:
                raise self._full()

    def _place(self, rows: int) -> str | None:
        """Where ``rows`` more would go now (under ``life.cond``): "start" (free slots, nobody
        queued before them), "queue", or None (the worker is full)."""
        life = self.life
        if len(life.active) + rows <= self.options.max_batch and not life.queue:
            return "start"
        return "queue" if life.queued + rows <= self.options.max_queued else None

    def _full(self) -> Overloaded:
        """The refusal of a full worker, counted (under ``life.cond``)."""
        life = self.life
        life.stats.rejected += 1
        return Overloaded(f"the worker is full: {len(life.active)} running (--max-batch {self.options.max_batch}) and "
                          f"{life.queued} queued (--max-queued {self.options.max_queued}); retry later or on another replica")

    def abort(self, rows: list[Sequence], stopped: bool = False) -> None:
        """The consumer is gone (or, ``stopped``, found a stop string): free the rows' slots at the
        next step (consumer side)."""
        life = self.life
        with life.cond:
            live = [seq for seq in rows if not seq.done]
            for seq in live:
                seq.aborted, seq.stopped = True, seq.stopped or stopped  # the stream's final abort keeps it
            if live and live[0].phase is Phase.QUEUED:
                life.queue.remove(rows)
                life.stats.aborted += 1
                for seq in live:
                    life.finish(seq)
            life.cond.notify()

    def wake(self) -> None:
        """The consumer read a paused sequence's tokens (or a look for blocks ended): plan again."""
        with self.life.cond:
            self.life.cond.notify()

    def close(self) -> None:
        life = self.life
        with life.cond:
            self._closed = True
            life.cond.notify()
        self._thread.join()
        life.fail_all([*life.active, *(seq for rows in life.queue for seq in rows)],
                      Overloaded("the worker is shutting down"))
        life.deliver()

    # Everything below runs on the scheduler thread, except _start (under the lock, from submit).

    def _start(self, rows: list[Sequence]) -> None:
        """Gives every row a slot and starts the leader's store lookup (lock held)."""
        for seq in rows:
            seq.slot = self.runner.acquire(len(seq.prompt) + seq.max_new_tokens)
            seq.phase = Phase.WAITING
            self.life.active.append(seq)
        rows[0].phase = Phase.FETCHING
        self._read_pool.submit(self._fetch, rows[0])

    def _admittable(self) -> int | None:
        """Where in the queue the request to start now is: the head, if its rows fit the free
        slots; else, until the head has let ``max_batch`` requests pass, the first later one that
        fits. A group of rows waiting for slots that slow streams hold so leaves the free ones
        serving others, and still cannot be starved (lock held)."""
        queue = self.life.queue
        if not queue:
            return None
        free = self.options.max_batch - len(self.life.active)
        if len(queue[0]) <= free:
            return 0
        if queue[0][0].passed_by >= self.options.max_batch:
            return None
        return next((i for i in range(1, len(queue)) if len(queue[i]) <= free), None)

    def _admit(self) -> None:
        """Starts every request ``_admittable`` allows (lock held)."""
        queue = self.life.queue
        while (i := self._admittable()) is not None:
            rows = queue[i]
            del queue[i]
            if i:
                queue[0][0].passed_by += 1
            self._start(rows)

    def _fetch(self, seq: Sequence) -> None:
        try:
            complete = self.sources.fetch(seq, self.runner.receiver(seq), lambda: self.life.fetched(seq),
                                          self.runner.encoder_for(seq))
        except BaseException as exc:  # noqa: BLE001 - the connector degrades store errors itself; anything else fails this sequence
            with self.life.cond:
                self.life.fail(seq, exc)
                self.life.cond.notify()
            wake_consumers([seq])
            return
        if complete:
            self.life.fetched(seq)

    def schedule(self) -> StepPlan:
        """Reaps aborted sequences, hands free slots to the queue, and decides the next step (lock held)."""
        life = self.life
        for seq in [s for s in life.active if s.aborted]:
            if seq.stopped:
                life.complete(seq)
            else:
                life.stats.aborted += 1
                life.finish(seq)
        for seq in life.active:
            if seq.phase is Phase.DECODING:  # a client may have read since the sequence paused
                life.set_paused(seq, life.unread_full(seq))
        for seq in [s for s in life.active if s.paused and self._paused_too_long(s)]:
            life.fail(seq, Overloaded(
                f"stream paused for {self.options.max_paused_s:g} s with {len(seq.outbox)} tokens unread "
                "(--max-paused-s): the client stopped reading; its slot was given to others"))
            life.touch(seq)
        self._admit()
        plan = StepPlan()
        plan.assemble = [s for s in life.active if s.phase is Phase.PREFILLING and not s.assembled]
        budget = self.options.max_prefill_tokens_per_step
        for seq in life.active:
            if seq.phase is Phase.DECODING:
                if not seq.paused:
                    plan.decode.append(seq)
            elif seq.phase is Phase.PREFILLING and budget > 0:
                held = self.sources.plan_share(seq, life.active, plan, life.stats)
                if held is None or held == len(seq.prompt):
                    continue
                if held == seq.prefilled and not self.sources.may_compute(seq, plan, self.wake):
                    continue
                n = min(budget, len(seq.prompt) - held)
                plan.prefill.append((seq, n))
                budget -= n
        return plan

    def _paused_too_long(self, seq: Sequence) -> bool:
        return time.monotonic() - seq.paused_since >= self.options.max_paused_s

    def _has_work(self) -> bool:
        life = self.life
        return any(
            s.aborted or s.phase is Phase.PREFILLING
            or (s.phase is Phase.DECODING and not life.unread_full(s))
            or (s.paused and self._paused_too_long(s))
            for s in life.active
        ) or self._admittable() is not None

    def _idle_timeout(self) -> float | None:
        """Seconds until the earliest paused sequence runs out of patience (None: nobody paused)."""
        paused = [s.paused_since for s in self.life.active if s.paused]
        if not paused:
            return None
        return min(threading.TIMEOUT_MAX, max(0.0, min(paused) + self.options.max_paused_s - time.monotonic()))

    def _run(self) -> None:
        life = self.life
        while True:
            with life.cond:
                while not self._closed and not self._has_work():
                    life.cond.wait(self._idle_timeout())
                if self._closed:
                    return
                plan = self.schedule()
                if plan.empty:
                    # Only rows waiting for an earlier row's fetch: its end (or any submit, abort
                    # or read) notifies; the bound covers a paused row running out of patience.
                    life.cond.wait(min(self._idle_timeout() or IDLE_RECHECK_S, IDLE_RECHECK_S))
                    continue
            try:
                self.runner.execute(plan)
            except Exception as exc:  # noqa: BLE001 - a bug here must fail its sequences, never stop the worker
                log.exception("scheduler step failed")
                life.fail_all([*plan.decode, *(seq for seq, _ in plan.prefill)], exc)
                life.deliver()
