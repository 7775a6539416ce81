"""The scheduler: owns every active sequence of a worker and advances them in steps.

One thread runs the steps. Each step is decided by ``schedule()`` (a plain ``StepPlan``: which
sequences decode, which prefill chunks run) and carried out by ``execute()``:

- every sequence that is decoding advances in *one* model run (``SlotBank.decode``); a sequence
  joins that batch the step after its prefill ends and leaves the moment it finishes or is
  cancelled: nobody waits for a batch to drain;
- prefill chunks share one token budget per step (``max_prefill_tokens_per_step``), run after the
  decode, so the streams already decoding keep a bounded gap between tokens while long prompts
  arrive.

Admission is decided at the door, synchronously: a free slot is taken at once, else the request
waits in a queue of at most ``max_queued``; past that ``Overloaded`` is raised before any work is
done. The queue is served in order, except that a request needing more rows than are free lets
up to ``max_batch`` later ones that fit go first (``_admittable``). Store lookups run on the engine's read threads (the ``Hooks``), never on this thread.

A request with n samples or beams is admitted as one group of rows, all at once or not at all.
Its leader fetches and prefills; when the prompt is done its K/V is copied into the followers'
rows (``SlotBank.fork``) and every row picks its first token from the same logits. Samples then
decode as independent rows. Beams decode in lockstep: after each step ``BeamState.step`` picks
the kept continuations and their parents, and the rows' K/V are reordered by parent in one gather
(``SlotBank.reorder``); the hypotheses go out when the search ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from services.engine.generation import FinishReason
from services.engine.logprobs import log_softmax, token_logprobs
from services.engine.run_waits import PrefillPace
from services.engine.sequence import Ahead, Phase, Sequence, SequenceGroup
from services.errors import NumericalError, Overloaded
from services.runtime.slots import SlotBank

log = logging.getLogger(__name__)
IDLE_RECHECK_S = 0.05
MIN_PACE_TOKENS = 32
"""Prefill chunks shorter than this do not move the measured pace."""
TRAIL_MISSES = 2
"""Waits in a row that bring less than a chunk in time before a ``Trail`` ends (the holder is
gone or behind)."""


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


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start (tokens, runs, sequences); read by tests, benchmarks and logs."""

    admitted: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    """Sum over decode steps of the sequences advanced: decode_rows / decode_steps is the mean batch."""
    max_decode_rows: int = 0
    prefill_runs: int = 0
    prefill_tokens: int = 0
    """Prompt tokens computed (not served from the store or copied from another row)."""
    shared_tokens: int = 0
    """Prompt tokens copied from another row of this worker that computed (or fetched) the same
    prefix, instead of being computed again (in-worker single-flight)."""
    shared_waits: int = 0
    """Steps a prefilling sequence sat out because another row was about to hold its prefix."""
    adopted_tokens: int = 0
    """Prompt tokens taken from blocks another worker published after this one stopped waiting
    for them (``Trail``), instead of being computed twice."""


@dataclass(slots=True)
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, prompt tokens to run this step), in admission order."""
    assemble: list[Sequence] = field(default_factory=list)
    """Sequences whose fetch ended: their cached blocks go into their slots first thing, so that
    rows waiting for those blocks can copy them whether or not a chunk of theirs runs."""
    share: list[tuple[Sequence, Sequence, int]] = field(default_factory=list)
    """(sequence, row, tokens): the sequence's prompt up to ``tokens`` is copied from the other
    row, which holds it, before the step's model runs."""
    adopt: list[tuple[Sequence, Ahead]] = field(default_factory=list)
    """Blocks another worker published since the sequence stopped waiting for them (``Trail``):
    they go into its slot after what it holds."""

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.share and not self.assemble and not self.adopt


class Hooks(Protocol):
    """What the scheduler asks of the engine (which knows the store and the encoder)."""

    def fetch(self, seq: Sequence, done: Callable[[], None]) -> bool:
        """On a read thread: the store lookup; sets ``seq.lookup``, ``seq.prefilled`` and usage.
        Returns True when the lookup is complete; False when it goes on elsewhere (waiting for
        another worker's blocks), in which case ``done`` is called once it is."""

    def begin(self, seq: Sequence) -> None:
        """On the scheduler thread, before the first chunk: fills the slot from the lookup."""

    def prefilled(self, seq: Sequence) -> None:
        """On the scheduler thread, after each prompt chunk whose logits are finite: copies out the
        blocks completed so far, to publish (and, after the last chunk, ends the sequence's lease)."""

    def look_ahead(self, seq: Sequence) -> Future:
        """For a row on a ``Trail``, between two chunks: waits elsewhere, bounded by about what
        computing its next chunk would take it, for the blocks from its next one on. The future
        holds an ``Ahead``, or None when nothing came; it never fails (a store error brings
        nothing) and may be done already."""

    def finished(self, seq: Sequence) -> None:
        """On the scheduler thread, when a sequence ends by EOS, a stop token or its length, before
        its slot is freed: copies out the blocks its answer completed, to publish."""

    def distrust(self, seq: Sequence) -> bool:
        """On the scheduler thread, when the first token's logits are NaN or infinite: if any K/V
        came from the store, deletes those values, resets ``seq`` to compute its whole prompt and
        returns True; False when nothing came from the store."""


class Scheduler:
    def __init__(self, slots: SlotBank, options: SchedulerOptions, hooks: Hooks, read_pool: Executor,
                 pace: PrefillPace) -> None:
        self.slots = slots
        self.options = options
        self.stats = SchedulerStats()
        self.pace = pace
        """Measured prefill cost, observed after every chunk (how long computing a run would take)."""
        self._hooks = hooks
        self._read_pool = read_pool
        self._cond = threading.Condition()
        self._queue: deque[list[Sequence]] = deque()
        """Groups of rows (one request each) waiting for slots, in arrival order."""
        self._active: list[Sequence] = []
        """Sequences holding a slot, in admission order."""
        self._closed = False
        self._touched: dict[int, Sequence] = {}
        self._thread = threading.Thread(target=self._run, name="kv-scheduler", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def active(self) -> list[Sequence]:
        """The sequences holding a slot now, in admission order (a snapshot)."""
        with self._cond:
            return list(self._active)

    @property
    def queued(self) -> int:
        """Sequences (rows) waiting for a slot."""
        return sum(len(rows) for rows in self._queue)

    def submit(self, rows: list[Sequence]) -> None:
        """Admits one request's rows (one sequence, or a group) or raises ``Overloaded`` at once,
        naming what was full. ``len(rows)`` is at most ``max_batch`` (the engine checks)."""
        with self._cond:
            if self._closed:
                raise Overloaded("the worker is shutting down; retry on another replica")
            if len(self._active) + len(rows) <= self.options.max_batch and not self._queue:
                self._start(rows)
            elif self.queued + len(rows) <= self.options.max_queued:
                self._queue.append(rows)
                self._admit()
            else:
                self.stats.rejected += 1
                raise Overloaded(
                    f"the worker is full: {len(self._active)} running (--max-batch "
                    f"{self.options.max_batch}) and {self.queued} queued (--max-queued "
                    f"{self.options.max_queued}); retry later or on another replica")
            self.stats.admitted += 1

    def abort(self, rows: list[Sequence], stopped: bool = False) -> None:
        """The consumer is gone (or, ``stopped``, found a stop string): free the rows' slots at the
        next step (consumer side)."""
        with self._cond:
            live = [seq for seq in rows if not seq.done]
            for seq in live:
                seq.aborted, seq.stopped = True, seq.stopped or stopped  # the stream's final abort keeps it
            if live and live[0].phase is Phase.QUEUED:
                self._queue.remove(rows)
                self.stats.aborted += 1
                for seq in live:
                    self._finish(seq)
            self._cond.notify()

    def wake(self) -> None:
        """The consumer read a paused sequence's tokens: it may decode again."""
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self._fail_all([*self._active, *(seq for rows in self._queue for seq in rows)],
                       Overloaded("the worker is shutting down"))
        self._deliver()

    # Everything below runs on the scheduler thread, except _start (under the lock, from submit).

    def _start(self, rows: list[Sequence]) -> None:
        """Gives every row a slot and starts the leader's store lookup (lock held)."""
        for seq in rows:
            seq.slot = self.slots.acquire(len(seq.prompt) + seq.max_new_tokens)
            seq.phase = Phase.WAITING
            self._active.append(seq)
        rows[0].phase = Phase.FETCHING
        self._read_pool.submit(self._fetch, rows[0])

    def _admittable(self) -> int | None:
        """Where in the queue the request to start now is: the head, if its rows fit the free
        slots; else, until the head has let ``max_batch`` requests pass, the first later one that
        fits. A group of rows waiting for slots that slow streams hold so leaves the free ones
        serving others, and still cannot be starved (lock held)."""
        if not self._queue:
            return None
        free = self.options.max_batch - len(self._active)
        if len(self._queue[0]) <= free:
            return 0
        if self._queue[0][0].passed_by >= self.options.max_batch:
            return None
        return next((i for i in range(1, len(self._queue)) if len(self._queue[i]) <= free), None)

    def _admit(self) -> None:
        """Starts every request ``_admittable`` allows (lock held)."""
        while (i := self._admittable()) is not None:
            rows = self._queue[i]
            del self._queue[i]
            if i:
                self._queue[0][0].passed_by += 1
            self._start(rows)

    def _fetch(self, seq: Sequence) -> None:
        try:
            complete = self._hooks.fetch(seq, lambda: self._fetched(seq))
        except BaseException as exc:  # noqa: BLE001 - the hook degrades store errors itself; anything else fails this sequence
            with self._cond:
                self._fail(seq, exc)
                self._cond.notify()
            _wake_consumers([seq])
            return
        if complete:
            self._fetched(seq)

    def _fetched(self, seq: Sequence) -> None:
        with self._cond:
            if seq.phase is Phase.FETCHING:
                seq.phase = Phase.PREFILLING
            self._cond.notify()

    def _finish(self, seq: Sequence) -> None:
        """Frees the sequence's slot (lock held or scheduler thread)."""
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None
        if seq in self._active:
            self._active.remove(seq)
        seq.phase = Phase.FINISHED

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Ends ``seq`` with ``exc`` for its consumer (lock held); the caller wakes the consumer.
        Rows that depend on it end too: followers still queued or waiting for its prompt, and every
        beam (beams only advance together)."""
        if seq.done:
            return
        self.stats.failed += 1
        if seq.phase is Phase.QUEUED and seq.rows in self._queue:
            self._queue.remove(seq.rows)
        self._finish(seq)
        seq.outbox.append(exc)
        group = seq.group
        if group is not None:
            for row in group.rows:
                if row.phase in (Phase.QUEUED, Phase.WAITING) or group.beams is not None:
                    self._fail(row, exc)
                    self._touched[id(row)] = row

    def schedule(self) -> StepPlan:
        """Reaps aborted sequences, hands free slots to the queue, and decides the next step (lock held)."""
        for seq in [s for s in self._active if s.aborted]:
            if seq.stopped:
                self._hooks.finished(seq)
                self.stats.finished += 1
            else:
                self.stats.aborted += 1
            self._finish(seq)
        for seq in self._active:
            if seq.phase is Phase.DECODING:  # a client may have read since the sequence paused
                self._set_paused(seq, self._unread_full(seq))
        for seq in [s for s in self._active if s.paused and self._paused_too_long(s)]:
            self._fail(seq, Overloaded(
                f"stream paused for {self.options.max_paused_s:g} s with {len(seq.outbox)} tokens unread "
                "(--max-paused-s): the client stopped reading; its slot was given to others"))
            self._touched[id(seq)] = seq
        self._admit()
        plan = StepPlan()
        plan.assemble = [s for s in self._active if s.phase is Phase.PREFILLING and not s.assembled]
        budget = self.options.max_prefill_tokens_per_step
        for seq in self._active:
            if seq.phase is Phase.DECODING:
                if not seq.paused:
                    plan.decode.append(seq)
            elif seq.phase is Phase.PREFILLING and budget > 0:
                held = self._plan_share(seq, plan)
                if held is None or held == len(seq.prompt):
                    continue
                if seq.trail is not None and held == seq.prefilled and not self._looked(seq, plan):
                    continue
                n = min(budget, len(seq.prompt) - held)
                plan.prefill.append((seq, n))
                budget -= n
        return plan

    def _plan_share(self, seq: Sequence, plan: StepPlan) -> int | None:
        """In-worker single-flight (lock held): when another row shares full prompt blocks with
        ``seq`` beyond what ``seq`` holds, ``seq`` copies what that row holds of them (planned in
        ``plan.share``) and, while that row is still fetching or computing the rest, sits this step
        out instead of computing the same tokens. Returns the prompt tokens ``seq`` holds once this
        step's copies are done, or None: it sits this step out.

        The rows waited for are the row holding the fleet's lease on the prompt (it waits for
        nobody), rows admitted earlier, which come first for the prefill budget, and rows waiting
        in the store for another worker's blocks, whose wait depends on no row (and is bounded:
        ``run_waits``). So a sequence never waits longer than computing would take it, and waits
        never form a cycle."""
        if seq.prompt_logprobs is not None or seq.cache.skip_read or seq.lookup is None:
            return seq.prefilled  # prompt log-probabilities need every position computed; skip_read means cold
        size = seq.namespace.block_size
        holder = seq.lease is not None  # copies what is there, never waits: the others wait for it
        earlier = True
        for row in self._active:
            if row is seq:
                earlier = False
                continue
            if row.lookup is None or row.phase not in (Phase.FETCHING, Phase.PREFILLING, Phase.DECODING):
                continue
            shared = min(_common_blocks(seq.lookup.hashes, row.lookup.hashes) * size, len(seq.prompt) - 1)
            # Any row's K/V may be copied; a later row is waited for only if it holds the lease or
            # fetches (and then only for what it fetched, never for what it computes).
            waitable = earlier or row.lease is not None or row.awaiting
            if not earlier and row.lease is None and row.awaiting and row.phase is not Phase.FETCHING:
                shared = min(shared, row.lookup.hit_blocks * size)
            if shared <= seq.prefilled:
                continue
            held = 0
            if row.assembled and row.phase is not Phase.FETCHING:
                held = min(shared, row.slot.length)
            elif row in plan.assemble:  # its cached blocks go into its slot before the copies
                held = min(shared, row.prefilled)
            if held > seq.prefilled:
                plan.share.append((seq, row, held))
                return held if held == shared or holder or row.phase is Phase.DECODING else None
            if row.phase is Phase.DECODING or holder or not waitable:
                continue
            self.stats.shared_waits += 1
            return None
        return seq.prefilled

    def _looked(self, seq: Sequence, plan: StepPlan) -> bool:
        """Whether a row on a ``Trail`` may compute its next chunk this step (lock held): once a
        wait for the holder's blocks since its last chunk brought less than a chunk in time.
        Otherwise it starts that wait, or sits out while it runs; what came goes into its slot
        (``plan.adopt``) first, and a wait that kept up is followed by another."""
        trail = seq.trail
        if trail.looked:
            return True
        if trail.look is None:
            trail.look = self._hooks.look_ahead(seq)
            trail.look.add_done_callback(lambda _: self.wake())  # inline when done already
        if trail.look.done():
            ahead = trail.look.result() if trail.look.exception() is None else None
        elif time.monotonic() < trail.give_up_at:
            return False
        else:  # the store holds the wait's polls up: compute rather than wait on it
            ahead = None
        trail.look = None
        # A row that moved since the wait began (it copied from another row) holds what came.
        adopting = ahead is not None and ahead.start == seq.prefilled
        if adopting:
            plan.adopt.append((seq, ahead))
            if ahead.kept_up:
                trail.misses = 0
                return False
        trail.looked = True
        trail.misses += 1
        if trail.misses >= TRAIL_MISSES:
            seq.trail = None
        return not adopting

    def execute(self, plan: StepPlan) -> None:
        """Copies shared prefixes, runs the decode batch, then the prefill chunks; each finished
        run's tokens go out at once."""
        for seq in plan.assemble:
            try:
                self._assemble(seq)
            except Exception as exc:  # noqa: BLE001
                log.exception("assembling the cached prompt failed for request %s", seq.request_id)
                self._fail_all([seq], exc)
        for seq, row, tokens in plan.share:
            try:
                self._share(seq, row, tokens)
            except Exception as exc:  # noqa: BLE001
                log.exception("copying a shared prefix failed for request %s", seq.request_id)
                self._fail_all([seq], exc)
        for seq, ahead in plan.adopt:
            try:
                self._adopt(seq, ahead)
            except Exception as exc:  # noqa: BLE001
                log.exception("copying blocks published meanwhile failed for request %s", seq.request_id)
                self._fail_all([seq], exc)
        if plan.decode:
            try:
                logits = self.slots.decode([s.slot for s in plan.decode], [s.next_token for s in plan.decode])
            except Exception as exc:  # noqa: BLE001 - a failed run fails its rows; the worker keeps serving
                log.exception("decode step failed for %d sequences", len(plan.decode))
                self._fail_all(plan.decode, exc)
            else:
                self.stats.decode_steps += 1
                self.stats.decode_rows += len(plan.decode)
                self.stats.max_decode_rows = max(self.stats.max_decode_rows, len(plan.decode))
                self._sample(plan.decode, logits)
            self._deliver()
        for seq, n in plan.prefill:
            try:
                logits = self._prefill(seq, n)
                if logits is not None and not np.isfinite(logits).all():
                    self._non_finite(seq)
                elif logits is not None:
                    rows = self._fork(seq)
                    self._sample(rows, np.broadcast_to(logits, (len(rows), logits.shape[-1])))
            except Exception as exc:  # noqa: BLE001
                log.exception("prefill failed for request %s", seq.request_id)
                self._fail_all([seq], exc)
            self._deliver()

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The rows that pick a token from the logits ending ``seq``'s prompt: ``seq``, and for a
        group's leader every follower, which gets a copy of the prompt's K/V first."""
        group = seq.group
        if group is None:
            return [seq]
        followers = [row for row in group.rows[1:] if row.phase is Phase.WAITING]
        self.slots.fork(seq.slot, [row.slot for row in followers])
        for row in followers:
            row.prefilled, row.assembled = seq.prefilled, True
            row.usage.cached_prompt_tokens = seq.usage.cached_prompt_tokens
            row.usage.encoder_cache_hit = seq.usage.encoder_cache_hit
            row.timings.cache_fetch_ms, row.timings.prefill_ms = seq.timings.cache_fetch_ms, seq.timings.prefill_ms
        return [seq, *followers]

    def _assemble(self, seq: Sequence) -> None:
        """Puts the sequence's cached blocks (and cross K/V) into its slot, once."""
        if not seq.assembled and not seq.done:
            self._hooks.begin(seq)
            seq.assembled = True

    def _share(self, seq: Sequence, row: Sequence, tokens: int) -> None:
        """Copies ``row``'s first ``tokens`` tokens into ``seq``'s slot (both hold the same prompt
        up to there): tokens neither computed nor fetched again, counted as cached."""
        if seq.done or row.done:
            return
        t = time.perf_counter()
        self._assemble(seq)
        self.slots.share(row.slot, seq.slot, tokens)
        if not row.cache.skip_write:  # the row (or the store) has those blocks published
            seq.published_blocks = max(seq.published_blocks, tokens // seq.namespace.block_size)
        self.stats.shared_tokens += self._copied(seq, tokens, t)

    def _adopt(self, seq: Sequence, ahead: Ahead) -> None:
        """Puts blocks that another worker published (``Trail``) after the sequence's tokens:
        neither computed nor fetched again by anyone, counted as cached. Only where the wait
        began: blocks are positions."""
        if seq.done or ahead.start != seq.prefilled or ahead.tokens <= seq.prefilled:
            return
        t = time.perf_counter()
        self.slots.append(seq.slot, ahead.blocks, ahead.tokens)
        seq.published_blocks = max(seq.published_blocks,
                                   ahead.start // seq.namespace.block_size + len(ahead.blocks))
        self.stats.adopted_tokens += self._copied(seq, ahead.tokens, t)

    @staticmethod
    def _copied(seq: Sequence, tokens: int, began: float) -> int:
        """Books the prompt tokens up to ``tokens`` that were just copied into ``seq``'s slot from
        elsewhere (another row, another worker's blocks) as cached, the copy's time (since
        ``began``, perf_counter) as fetching; returns how many tokens that was."""
        copied = tokens - seq.prefilled
        seq.prefilled = tokens
        seq.usage.cached_prompt_tokens += copied
        seq.timings.cache_fetch_ms += (time.perf_counter() - began) * 1e3
        return copied

    def _prefill(self, seq: Sequence, n: int) -> np.ndarray | None:
        """Runs the next ``n`` prompt tokens of ``seq``; the logits once the prompt is done, else None."""
        t = time.perf_counter()
        self._assemble(seq)
        t_run = time.perf_counter()
        start = seq.prefilled
        chunk = seq.prompt[start : start + n]
        if seq.prompt_logprobs is None:
            logits = self.slots.prefill(seq.slot, chunk)
        else:
            positions = self.slots.prefill(seq.slot, chunk, all_positions=True)
            # Position j predicts prompt token start + j + 1; the prompt's last position predicts
            # the first generated token instead.
            predicted = seq.prompt[start + 1 : start + n + 1]
            seq.prompt_logprobs += token_logprobs(positions[: len(predicted)], predicted, seq.top_logprobs)
            logits = positions[-1]
        seq.prefilled += n
        if seq.trail is not None:
            seq.trail.looked = False
            if n >= MIN_PACE_TOKENS:
                seq.trail.ms_per_token = (time.perf_counter() - t_run) * 1e3 / n
        self.stats.prefill_runs += 1
        self.stats.prefill_tokens += n
        end = time.perf_counter()
        seq.timings.prefill_ms += (end - t) * 1e3
        if n >= MIN_PACE_TOKENS:  # a chunk of a few tokens costs its fixed overhead, not its tokens
            self.pace.observe(n, (end - t_run) * 1e3)
        if np.isfinite(logits).all():  # K/V whose logits blew up is never published (see _non_finite)
            self._hooks.prefilled(seq)
        return logits if seq.prefilled == len(seq.prompt) else None

    def _sample(self, seqs: list[Sequence], logits: np.ndarray) -> None:
        """Picks each row's token (plain greedy rows in one vectorised arg-max; beams by their
        group's search) and sends it out. A row whose logits are not all finite picks nothing (see
        ``_non_finite``); a row whose sampler fails fails alone: the batch goes on."""
        finite = np.isfinite(logits).all(axis=1)
        tokens = np.empty(len(seqs), dtype=np.int64)
        greedy = [i for i, s in enumerate(seqs) if s.sampler.config.greedy and s.adjust is None]
        if greedy:
            tokens[greedy] = np.argmax(logits[greedy], axis=1)
        searches: dict[int, tuple[SequenceGroup, list[int]]] = {}
        for i, seq in enumerate(seqs):
            if seq.group is not None and seq.group.beams is not None:
                searches.setdefault(id(seq.group), (seq.group, []))[1].append(i)
                continue
            if not finite[i]:
                self._non_finite(seq)
                continue
            if seq.adjust is not None or not seq.sampler.config.greedy:
                scores = seq.adjust(logits[i]) if seq.adjust is not None else logits[i]
                try:
                    tokens[i] = np.argmax(scores) if seq.sampler.config.greedy else seq.sampler(scores)
                except Exception as exc:  # noqa: BLE001 - one row's failure must not end the others
                    log.exception("sampling failed for request %s", seq.request_id)
                    self._fail_all([seq], exc)
                    continue
            self._emit(seq, int(tokens[i]), logits[i])
        for group, rows in searches.values():
            try:
                self._beam_step(group, logits[rows], bool(finite[rows].all()))
            except Exception as exc:  # noqa: BLE001 - one search's failure must not end the other rows
                log.exception("beam search step failed for request %s", group.rows[0].request_id)
                self._fail_all(group.rows, exc)

    def _beam_step(self, group: SequenceGroup, logits: np.ndarray, finite: bool) -> None:
        """One step of a beam search over its rows' logits ``[num_beams, vocab]`` (rows in group
        order): keeps the best continuations, reorders the rows' K/V by parent, and when the
        search is done sends the best hypotheses out on the first ``group.outputs`` rows."""
        rows, state = group.rows, group.beams
        if not finite:
            self._fail_all(rows, NumericalError(
                f"the model produced NaN or infinite logits at beam search step {rows[0].generated + 1}"))
            return
        # Penalties act on the log-probabilities here, as Hugging Face's processors do in beam search.
        logprobs = log_softmax(logits)
        if rows[0].adjust is not None:
            logprobs = np.stack([r.adjust(logprobs[i]) for i, r in enumerate(rows)])
        parents, tokens = state.step(logprobs)
        # Every row holds the same prompt: only the generated tokens differ between beams.
        self.slots.reorder([r.slot for r in rows], parents, len(rows[0].prompt))
        if rows[0].adjust is not None:
            adjusters = [rows[p].adjust.fork() for p in parents]
            for row, adjuster in zip(rows, adjusters, strict=True):
                row.adjust = adjuster
        now = time.perf_counter()
        for row, token in zip(rows, tokens, strict=True):
            row.generated += 1
            row.next_token = int(token)
            row.phase = Phase.DECODING
            if row.adjust is not None:
                row.adjust.observe(int(token))
        if not state.done and rows[0].generated < rows[0].max_new_tokens:
            return
        for row, hypothesis in zip(rows[: group.outputs], state.finalize(), strict=False):
            row.timings.time_to_first_token_ms = (now - row.t0) * 1e3
            row.beam_score = hypothesis.score
            last = FinishReason.LENGTH if hypothesis.stop_token is None else row.ended_by(hypothesis.stop_token)
            for k, token in enumerate(hypothesis.tokens):
                row.outbox.append((token, last if k == len(hypothesis.tokens) - 1 else None, None))
            self._touched[id(row)] = row
        with self._cond:
            self.stats.finished += 1
            for row in rows:
                self._finish(row)

    def _non_finite(self, seq: Sequence) -> None:
        """NaN or infinite logits. At the first token over K/V from the store, that K/V is the
        suspect: the engine drops it and the prompt is computed again from its first token (the
        client has seen nothing yet). Otherwise the model itself failed: this request fails."""
        if seq.generated == 0 and self._hooks.distrust(seq):
            seq.assembled = False
            return
        self._fail_all([seq], NumericalError(
            f"the model produced NaN or infinite logits at generated token {seq.generated + 1}; "
            "nothing was sent from them"))

    def _emit(self, seq: Sequence, token: int, logits: np.ndarray) -> None:
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
        self._touched[id(seq)] = seq
        if reason is None:
            seq.next_token = token
            seq.phase = Phase.DECODING
            self._set_paused(seq, self._unread_full(seq))
            return
        self._hooks.finished(seq)
        with self._cond:
            self.stats.finished += 1
            self._finish(seq)

    def _fail_all(self, seqs: list[Sequence], exc: BaseException) -> None:
        with self._cond:
            for seq in seqs:
                self._fail(seq, exc)
                self._touched[id(seq)] = seq

    def _deliver(self) -> None:
        """Wakes the consumers of every sequence with new output: one call per event loop."""
        touched, self._touched = list(self._touched.values()), {}
        _wake_consumers(touched)

    def _unread_full(self, seq: Sequence) -> bool:
        """Whether the consumer has ``max_unread_tokens`` tokens still to read (the sequence pauses)."""
        return len(seq.outbox) >= self.options.max_unread_tokens

    @staticmethod
    def _set_paused(seq: Sequence, paused: bool) -> None:
        if paused and not seq.paused:
            seq.paused_since = time.monotonic()
        seq.paused = paused

    def _paused_too_long(self, seq: Sequence) -> bool:
        return time.monotonic() - seq.paused_since >= self.options.max_paused_s

    def _has_work(self) -> bool:
        return any(
            s.aborted or s.phase is Phase.PREFILLING
            or (s.phase is Phase.DECODING and not self._unread_full(s))
            or (s.paused and self._paused_too_long(s))
            for s in self._active
        ) or self._admittable() is not None

    def _idle_timeout(self) -> float | None:
        """Seconds until the earliest paused sequence runs out of patience (None: nobody paused)."""
        paused = [s.paused_since for s in self._active if s.paused]
        if not paused:
            return None
        return min(threading.TIMEOUT_MAX, max(0.0, min(paused) + self.options.max_paused_s - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._has_work():
                    self._cond.wait(self._idle_timeout())
                if self._closed:
                    return
                plan = self.schedule()
                if plan.empty:
                    # Only rows waiting for an earlier row's fetch: its end (or any submit, abort
                    # or read) notifies; the bound covers a paused row running out of patience.
                    self._cond.wait(min(self._idle_timeout() or IDLE_RECHECK_S, IDLE_RECHECK_S))
                    continue
            try:
                self.execute(plan)
            except Exception as exc:  # noqa: BLE001 - a bug here must fail its sequences, never stop the worker
                log.exception("scheduler step failed")
                self._fail_all([*plan.decode, *(seq for seq, _ in plan.prefill)], exc)
                self._deliver()


def _common_blocks(a: list, b: list) -> int:
    """How many leading block hashes two prompts share (chained hashes: equal up to there)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _set_ready(seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.ready.set()


def _wake_consumers(seqs: list[Sequence]) -> None:
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

