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

Admission is decided at the door, before a request is tokenized (``reserve``): its rows are
reserved, counted against the worker (slots, then a queue of at most ``max_queued``) and against
its client's share (``fair_share``), or ``Overloaded`` is raised at once; once prepared they take a
free slot or wait in the queue (``submit``). The queue is served fairly: the next free slot goes to
the waiting request whose client holds the fewest slots, in arrival order among equals; a request
needing more rows than are free lets up to ``max_batch`` others that fit go first
(``_admittable``). A request that finds the worker full takes the queue place of the newest
queued request of the client holding the most rows (``_push_out``); while another client waits, a
client holding more than its fair part of the slots gives up those of its streams that have been
paused (not read) for ``yield_paused_s`` (``_yielding``). Store lookups run on the read threads
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
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.engine.fair_share import fair_slots
from services.engine.lifecycle import wake_consumers
from services.engine.runner import ModelRunner
from services.engine.sequence import Phase, Sequence
from services.engine.step_plan import SchedulerStats, StepPlan
from services.errors import Overloaded, Unavailable

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
    max_unread_bytes: int = 64 * 1024
    """A sequence whose unread tokens' messages would take about this many bytes pauses too
    (``output_processor.unread_limit``: log-probabilities make a token up to ~50x larger)."""
    max_client_rows: int = 0
    """Rows one client may hold (being prepared, queued or in a slot); 0: no fixed bound, only the
    fair shares kept when clients contend (``fair_share``)."""
    yield_paused_s: float = 2.0
    """While another client waits for a slot, a stream paused this long whose client holds more
    than its fair part of the slots is ended with ``Overloaded``, freeing its slot."""
    stream_interval: int = 1
    """Tokens a stream's consumer is woken for at once: 1 hands over each token as it is made; N
    hands over every N tokens (the first, the last and one held ``lifecycle.MAX_HOLD_S`` at once;
    every token of a request with stop strings), so a stream takes fewer, larger messages and its
    worker fewer wake-ups per token (vLLM's ``--stream-interval``)."""


@dataclass(slots=True, eq=False)
class Reservation:
    """Rows a request holds from the door, before it is prepared, until ``Scheduler.submit``
    places them or ``Scheduler.cancel`` gives them back (0 rows: a row count validation refuses)."""

    client: str
    rows: int
    open: bool = True


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

    def check_room(self, client: str) -> None:
        """Raises ``Overloaded`` (counted) when a one-row request of ``client`` would be refused now
        (``reserve``'s answer, nobody pushed out): asked at the door before a call's body is read.
        It reserves nothing; ``reserve`` decides again once the request is known."""
        with self.life.cond:
            self._refuse_over_share(client, 1)
            if self._victims(client, 1) is None:
                raise self._full()

    def reserve(self, client: str, rows: int) -> Reservation:
        """Reserves ``rows`` rows for a request of ``client`` before it is prepared, or raises
        ``Overloaded`` (counted) at once: the worker is full counting every request that passed
        the door before it, or the client holds its share. A row count no request may have is left
        to validation, which says why."""
        life = self.life
        with life.cond:
            if not 1 <= rows <= self.options.max_batch:
                self._refuse_closed()
                return Reservation(client, 0)
            self._refuse_over_share(client, rows)
            if not self._push_out(client, rows):
                raise self._full()
            life.shares.take(client, rows)
            return Reservation(client, rows)

    def _refuse_closed(self) -> None:
        """Raises ``Unavailable`` once the scheduler thread died, ``Overloaded`` while the worker
        shuts down (lock held)."""
        if self.died is not None:
            raise Unavailable(f"this worker's scheduler stopped ({type(self.died).__name__}: {self.died}); it is "
                              "exiting: retry on another replica")
        if self._closed:
            raise Overloaded("the worker is shutting down; retry on another replica")

    def _refuse_over_share(self, client: str, rows: int) -> None:
        """Raises ``Overloaded`` (counted) when the worker is closing or ``rows`` more would put
        ``client`` over its share (lock held)."""
        life = self.life
        self._refuse_closed()
        if life.shares.over(client, rows):
            life.stats.rejected += 1
            life.stats.client_rejected += 1
            raise Overloaded(
                f"this client ({client or 'in-process'}) already holds {life.shares.held[client]} rows being prepared, "
                f"queued or running; at most {life.shares.max_rows} per client (--max-client-rows): end or read "
                "its streams, or retry later")

    def _victims(self, client: str, rows: int) -> list[list[Sequence]] | None:
        """The queued requests to refuse so that ``rows`` more of ``client`` fit a full worker, or
        None when refusing every one that may be would not make room (lock held): the newest
        queued requests of the clients holding the most rows, while such a client holds more than
        ``client`` would. A client alone keeps the whole queue; clients contending for it end up
        holding equal parts."""
        life = self.life
        reserved = life.shares.reserved
        if self._place(rows, reserved) is not None:
            return []
        held, victims = Counter(life.shares.held), []
        mine = held[client] + rows
        while True:
            queued = [r for r in life.queue if r[0].client != client and held[r[0].client] > mine
                      and not any(r is v for v in victims)]
            if not queued:
                return None
            most = max(held[r[0].client] for r in queued)
            victim = next(r for r in reversed(queued) if held[r[0].client] == most)
            victims.append(victim)
            held[victim[0].client] -= len(victim)
            if self._place(rows, reserved, victims) is not None:
                return victims

    def _push_out(self, client: str, rows: int) -> bool:
        """Whether ``rows`` more of ``client`` fit, after refusing the queued requests ``_victims``
        names (lock held)."""
        life = self.life
        victims = self._victims(client, rows)
        if victims is None:
            return False
        for victim in victims:
            life.stats.pushed_out += 1
            exc = Overloaded(
                f"refused while queued: the worker was full and another client arrived holding fewer rows than this "
                f"client's {life.shares.held[victim[0].client]} (running, queued or being prepared), the most of any "
                "client; retry later or on another replica")
            for seq in victim:
                life.fail(seq, exc)
            wake_consumers(victim)
        return True

    def submit(self, rows: list[Sequence], reservation: Reservation) -> None:
        """Places one request's rows (one sequence, or a group), prepared since ``reservation``: a
        free slot, else the queue, else ``Overloaded``. ``len(rows)`` is at most ``max_batch``
        (the engine checks)."""
        life = self.life
        with life.cond:
            if reservation.open:
                reservation.open = False
                life.shares.placed(reservation.rows)
            if self._closed or self.died is not None:
                life.shares.release(reservation.client, reservation.rows)
                self._refuse_closed()
            place = self._place(len(rows))
            if place == "start":
                self._start(rows)
            elif place == "queue":
                life.queue.append(rows)
                self._admit()
                # A waiter shortens the paused streams' patience to yield_paused_s: the scheduler
                # thread may be asleep on a max_paused_s timeout computed before it came.
                life.cond.notify()
            else:
                life.shares.release(reservation.client, reservation.rows)
                raise self._full()
            life.stats.admitted += 1

    def cancel(self, reservation: Reservation) -> None:
        """Gives back a reservation whose request was refused or cancelled while being prepared."""
        with self.life.cond:
            if reservation.open:
                reservation.open = False
                self.life.shares.placed(reservation.rows)
                self.life.shares.release(reservation.client, reservation.rows)

    def _place(self, rows: int, reserved: int = 0, without: list[list[Sequence]] = ()) -> str | None:
        """Where ``rows`` more would go now, after ``reserved`` rows of requests still being prepared
        and with the queued requests ``without`` gone (under ``life.cond``): "start" (free slots,
        nobody queued before them), "queue", or None (the worker is full)."""
        life, batch = self.life, self.options.max_batch
        queued = life.queued - sum(len(r) for r in without)
        if len(life.active) + reserved + rows <= batch and not queued:
            return "start"
        # The reserved rows that find no free slot will queue ahead of these.
        ahead = reserved if queued else max(0, len(life.active) + reserved - batch)
        return "queue" if queued + ahead + rows <= self.options.max_queued else None

    def _full(self) -> Overloaded:
        """The refusal of a full worker, counted (under ``life.cond``)."""
        life = self.life
        life.stats.rejected += 1
        preparing = f", {life.shares.reserved} being prepared" if life.shares.reserved else ""
        return Overloaded(f"the worker is full: {len(life.active)} running (--max-batch {self.options.max_batch}) and "
                          f"{life.queued} queued (--max-queued {self.options.max_queued}){preparing}; retry later or "
                          "on another replica")

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

    def _admittable(self) -> tuple[int, int] | None:
        """(where in the queue the request to start now is, where its head is), or None. The head
        is the earliest request of the client holding the fewest slots. It starts if its rows fit
        the free slots; else, until the head has let ``max_batch`` requests pass, the first other
        one (in the same order) that fits. A group of rows waiting for slots that slow streams hold
        so leaves the free ones serving others, and still cannot be starved (lock held)."""
        queue = self.life.queue
        free = self.options.max_batch - len(self.life.active)
        if not queue or free <= 0:
            return None
        running = Counter(s.client for s in self.life.active)
        order = sorted(range(len(queue)), key=lambda i: running[queue[i][0].client])  # stable: arrival order
        head = order[0]
        if len(queue[head]) <= free:
            return head, head
        if queue[head][0].passed_by >= self.options.max_batch:
            return None
        return next(((i, head) for i in order[1:] if len(queue[i]) <= free), None)

    def _admit(self) -> None:
        """Starts every request ``_admittable`` allows (lock held)."""
        queue = self.life.queue
        while (found := self._admittable()) is not None:
            i, head = found
            rows = queue[i]
            if i != head:
                queue[head][0].passed_by += 1
            del queue[i]
            self._start(rows)

    def _yielding(self) -> list[Sequence]:
        """Paused streams (their clients not reading) that give up their slots to another client
        waiting for one: the client holds more than its fair part of the slots (``fair_slots``
        among the clients running or waiting), and the stream has been paused ``yield_paused_s``.
        At most as many as the other clients' rows waiting (lock held)."""
        life = self.life
        if not life.queue:
            return []
        waiting = Counter()
        for rows in life.queue:
            waiting[rows[0].client] += len(rows)
        running = Counter(s.client for s in life.active)
        share = fair_slots(self.options.max_batch, len(waiting.keys() | running.keys()))
        patience = min(self.options.yield_paused_s, self.options.max_paused_s)
        now, yielding = time.monotonic(), []
        for seq in life.active:
            others = sum(waiting.values()) - waiting[seq.client]
            if (seq.paused and running[seq.client] > share and others > len(yielding)
                    and now - seq.paused_since >= patience):
                yielding.append(seq)
                running[seq.client] -= 1
        return yielding

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
        ) or self._admittable() is not None or bool(self._yielding())

    def _idle_timeout(self) -> float | None:
        """Seconds until the earliest paused sequence runs out of patience (None: nobody paused):
        ``yield_paused_s`` while requests wait for slots, else ``max_paused_s``."""
        paused = [s.paused_since for s in self.life.active if s.paused]
        if not paused:
            return None
        patience = self.options.max_paused_s
        if self.life.queue:
            patience = min(patience, self.options.yield_paused_s)
        return min(threading.TIMEOUT_MAX, max(0.0, min(paused) + patience - time.monotonic()))

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
