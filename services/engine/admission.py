"""Who gets in and who waits: the scheduler's door, its queue and its fair shares.

Admission is decided at the door, before a request is tokenized (``reserve``; ``check_room``
before its body is even read): its rows are reserved, counted against the worker (slots, then a
queue of at most ``max_queued``) and against its client's share (``fair_share``), or ``Overloaded``
is raised at once; once prepared they take a free slot or wait in the queue (``submit``). The
queue is served fairly: the next free slot goes to the waiting request whose client holds the
fewest slots, in arrival order among equals; a request needing more rows than are free lets up
to ``max_batch`` others that fit go first (``_admittable``). A request that finds the worker full
takes the queue place of the newest queued request of the client holding the most rows
(``_push_out``); while another client waits, a client holding more than its fair part of the slots
gives up those of its streams that have been paused (not read) for ``yield_paused_s``
(``_yielding``). A queued request that could no longer be prefilled before its caller's deadline
is refused then (``_refuse_late``), never left to end DEADLINE_EXCEEDED.

``Admission`` is the part of ``Scheduler`` that decides these; every method runs with
``life.cond`` held, except the public ones, which take it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from services.engine.fair_share import fair_slots
from services.engine.lifecycle import Lifecycle, wake_consumers
from services.engine.runner import ModelRunner
from services.engine.scheduler_options import SchedulerOptions
from services.engine.sequence import Sequence
from services.errors import Overloaded, Unavailable

REFUSAL_MARGIN_S = 0.5
"""A queued request is refused this long before the latest moment its prompt could still start
and be prefilled by its caller's deadline: time for the refusal to reach the caller first."""


@dataclass(slots=True, eq=False)
class Reservation:
    """Rows a request holds from the door, before it is prepared, until ``Scheduler.submit``
    places them or ``Scheduler.cancel`` gives them back (0 rows: a row count validation refuses)."""

    client: str
    rows: int
    open: bool = True


class Admission:
    """The door, the queue and the shares of a ``Scheduler`` (its base): what they read of it."""

    life: Lifecycle
    runner: ModelRunner
    options: SchedulerOptions
    died: BaseException | None
    _closed: bool

    def _start(self, rows: list[Sequence]) -> None:
        raise NotImplementedError  # the Scheduler's: gives the rows slots and starts the leader's fetch

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
            self._refuse_queued(victim, exc)
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

    def _refused_at(self, rows: list[Sequence]) -> float | None:
        """When a queued request is refused for its deadline (``time.monotonic()``; None: it has
        none): the deadline, less what prefilling its own prompt is expected to take at this
        worker's measured pace, less ``REFUSAL_MARGIN_S``. The prompts ahead of it are not counted:
        an estimate of their time could refuse a request that would have made it."""
        deadline = rows[0].deadline
        if deadline is None:
            return None
        return deadline - self.runner.pace.expected_ms(len(rows[0].prompt)) / 1e3 - REFUSAL_MARGIN_S

    def _too_late(self) -> list[list[Sequence]]:
        """Queued requests that could no longer start and be prefilled before their callers'
        deadlines (lock held)."""
        now = time.monotonic()
        return [rows for rows in self.life.queue if (at := self._refused_at(rows)) is not None and at <= now]

    def _refuse_late(self) -> None:
        """Refuses ``_too_late`` requests ``Overloaded`` (RESOURCE_EXHAUSTED), waking their callers,
        rather than leaving them to end DEADLINE_EXCEEDED in the queue (lock held)."""
        life = self.life
        for rows in self._too_late():
            life.stats.rejected += 1
            left = max(0.0, rows[0].deadline - time.monotonic())
            exc = Overloaded(f"refused while queued: this request could not start before its deadline ({left:.1f} s "
                             f"left, {life.queued} rows queued, {len(life.active)} running); retry later or on "
                             "another replica")
            self._refuse_queued(rows, exc)

    def _refuse_queued(self, rows: list[Sequence], exc: Overloaded) -> None:
        """Ends a queued request's rows with ``exc`` and wakes its caller now (lock held)."""
        for seq in rows:
            self.life.fail(seq, exc)
        wake_consumers(rows)
