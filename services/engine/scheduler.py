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

Who is admitted, who waits in the queue and who is refused is ``Admission``'s (the base of
``Scheduler``, ``services/engine/admission.py``). Store lookups run on the read threads
and encoder runs on the encoder thread (the KV connector's scheduler side), never on this thread:
a row is planned once its fetch has ended. The connector also says which rows copy their
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
from typing import Protocol

import numpy as np

from services.engine.admission import Admission
from services.engine.lifecycle import wake_consumers
from services.engine.runner import ModelRunner
from services.engine.scheduler_options import SchedulerOptions
from services.engine.sequence import Phase, Sequence
from services.engine.step_plan import SchedulerStats, StepPlan
from services.errors import Overloaded, Unavailable

log = logging.getLogger(__name__)
IDLE_RECHECK_S = 0.05


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


class Scheduler(Admission):
    def __init__(self, runner: ModelRunner, sources: PrefixSources, options: SchedulerOptions,
                 read_pool: Executor) -> None:
        self.runner = runner
        self.sources = sources
        self.options = options
        self.life = runner.lifecycle
        self._read_pool = read_pool
        self._closed = False
        self._ending: BaseException | None = None
        self.died: BaseException | None = None
        """What stopped the scheduler thread (a bug: ``schedule`` raised), once it has."""
        self.on_death: list[Callable[[BaseException], None]] = []
        """Called on the scheduler thread, once, after the thread's fatal error failed every
        request in flight (the server turns NOT_SERVING and exits)."""
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

    def end_all(self, exc: BaseException) -> None:
        """Ends every request running or queued with ``exc`` at the next planning, and each one
        submitted later (a worker whose drain is over: a stream that sent tokens ends with ABORT)."""
        with self.life.cond:
            self._ending = exc
            self.life.cond.notify()

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
        plan = StepPlan()
        for seq in [s for s in life.active if s.aborted]:
            if seq.stopped:
                # Completed by the caller once the lock is given back: publishing the answer
                # copies its K/V, which must not hold up the door or the consumers.
                plan.completing.append(seq)
            else:
                life.stats.aborted += 1
                life.finish(seq)
        if self._ending is not None:
            for seq in [*life.active, *(seq for rows in life.queue for seq in rows)]:
                if not seq.aborted:
                    life.fail(seq, self._ending)
                    life.touch(seq)
        for seq in life.active:
            if seq.phase is Phase.DECODING and not seq.aborted:  # a client may have read since it paused
                life.set_paused(seq, life.unread_full(seq))
        for seq in [s for s in life.active if s.paused and not s.aborted and self._paused_too_long(s)]:
            life.fail(seq, Overloaded(
                f"stream paused for {self.options.max_paused_s:g} s with {len(seq.outbox)} tokens unread "
                "(--max-paused-s): the client stopped reading; its slot was given to others"))
            life.touch(seq)
        for seq in self._yielding():
            life.stats.yielded += 1
            life.fail(seq, Overloaded(
                f"stream paused with {len(seq.outbox)} tokens unread while another client waited for a slot, and "
                f"its client held more than its fair part of the {self.options.max_batch} slots (--yield-paused-s "
                f"{self.options.yield_paused_s:g}): its slot was given to the waiting client; read streams as they come"))
            life.touch(seq)
        self._admit()
        self._refuse_late()
        plan.assemble = [s for s in life.active if s.phase is Phase.PREFILLING and not s.assembled]
        budget = self.options.max_prefill_tokens_per_step
        for seq in life.active:
            if seq.aborted:
                continue
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
        ) or (self._ending is not None and bool(life.active or life.queue)) or self._admittable() is not None \
            or bool(self._yielding()) or bool(self._too_late())

    def _idle_timeout(self) -> float | None:
        """Seconds until the earliest paused sequence runs out of patience (``yield_paused_s``
        while requests wait for slots, else ``max_paused_s``) or the earliest queued request is
        refused for its deadline; None: neither can happen."""
        now = time.monotonic()
        patience = self.options.max_paused_s
        if self.life.queue:
            patience = min(patience, self.options.yield_paused_s)
        times = [s.paused_since + patience for s in self.life.active if s.paused]
        times += [at for rows in self.life.queue if (at := self._refused_at(rows)) is not None]
        if not times:
            return None
        return min(threading.TIMEOUT_MAX, max(0.0, min(times) - now))

    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as exc:  # noqa: BLE001 - whatever stops this thread must be told, never swallowed
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """The thread's end on a bug in planning (``schedule`` raised, its state no longer to be
        trusted): logged once with the requests in flight, each of them failed ``Unavailable``,
        new ones refused, and ``on_death`` told, so the worker stops rather than hangs."""
        life = self.life
        with life.cond:
            self.died = exc
            in_flight = [*life.active, *(seq for rows in life.queue for seq in rows)]
        ids = sorted({seq.request_id or "(no id)" for seq in in_flight})
        log.critical("the scheduler thread stopped on %s: %s; failing the %d requests in flight (%s), reporting "
                     "NOT_SERVING and exiting", type(exc).__name__, exc, len(ids), ", ".join(ids[:20]) +
                     (f" and {len(ids) - 20} more" if len(ids) > 20 else ""), exc_info=exc)
        try:
            life.fail_all(in_flight, Unavailable(f"this worker's scheduler stopped ({type(exc).__name__}); it is "
                                                 "exiting: retry on another replica"))
            life.deliver()
        finally:
            for tell in self.on_death:
                tell(exc)

    def _steps(self) -> None:
        life = self.life
        while True:
            with life.cond:
                while not self._closed and not self._has_work():
                    life.cond.wait(self._idle_timeout())
                if self._closed:
                    return
                plan = self.schedule()
                if plan.empty:
                    life.deliver()  # what planning failed (a paused stream, the drain's end) goes out now
                    # Only rows waiting for an earlier row's fetch: its end (or any submit, abort
                    # or read) notifies; the bound covers a paused row running out of patience.
                    life.cond.wait(min(self._idle_timeout() or IDLE_RECHECK_S, IDLE_RECHECK_S))
                    continue
            for seq in plan.completing:
                life.complete(seq)
            if not plan.runs:
                continue
            try:
                self.runner.execute(plan)
            except Exception as exc:  # noqa: BLE001 - a bug here must fail its sequences, never stop the worker
                rows = [*plan.decode, *(seq for seq, _ in plan.prefill)]
                log.exception("a model step failed; failing its %d rows (requests %s)", len(rows),
                              ", ".join(sorted({seq.request_id or "(no id)" for seq in rows})))
                life.fail_all(rows, exc)
                life.deliver()
