"""The model runner: carries out a ``StepPlan`` on the scheduler thread, and is the only code that
holds the slot bank and the ONNX Runtime sessions.

A step copies shared prefixes into slots, runs one batched decode over every decoding row, then the
prefill chunks; each run's tokens are sampled per row (plain greedy rows in one vectorised
arg-max) and go out at once. Beams decode in lockstep: after each step ``BeamState.step`` picks
the kept continuations and their parents, and the rows' K/V are reordered by parent in one gather
(``SlotBank.reorder``); the hypotheses go out when the search ends. NaN or infinite logits never
produce a token: at the first token over K/V from elsewhere that K/V is dropped and the prompt
computed again; otherwise the request fails. The KV connector's worker side is handed the bank for
its block copies (as vLLM's runner registers its KV caches with its connector).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from services.engine.fair_share import ClientShares
from services.engine.generation import FinishReason
from services.engine.kv_connector.state import Ahead
from services.engine.lifecycle import Lifecycle
from services.engine.logprobs import log_softmax, token_logprobs
from services.engine.run_waits import MIN_PACE_TOKENS, PrefillPace
from services.engine.sequence import Phase, Sequence, SequenceGroup
from services.engine.step_plan import StepPlan
from services.errors import InvalidRequest, NumericalError
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.onnx_encoder import EncoderSession
from services.runtime.slots import Slot, SlotBank, open_slots
from services.runtime.split_rule import EVERY_RUN, SplitRule

log = logging.getLogger(__name__)


class KVTransfer(Protocol):
    """What the runner asks of the KV connector's worker side (``KVConnectorWorker``)."""

    def load(self, seq: Sequence, slots: SlotBank) -> None: ...

    def encode(self, seq: Sequence, encode: Callable[[], np.ndarray]) -> Future: ...

    def share(self, seq: Sequence, row: Sequence, tokens: int, slots: SlotBank, began: float) -> int: ...

    def adopt(self, seq: Sequence, ahead: Ahead, slots: SlotBank) -> int: ...

    def chunk_done(self, seq: Sequence, slots: SlotBank, tokens: int, run_ms: float, finite: bool) -> None: ...

    def save_answer(self, seq: Sequence, slots: SlotBank) -> None: ...

    def answer_end(self, seq: Sequence) -> int | None: ...

    def distrust(self, seq: Sequence) -> bool: ...


class ModelRunner:
    def __init__(self, session: DecoderSession, encoder: EncoderSession | None, max_batch: int, context_length: int,
                 kv: KVTransfer, pace: PrefillPace, shares: ClientShares, prefill_rule: SplitRule = EVERY_RUN,
                 decode_rule: SplitRule = EVERY_RUN, recompute_answers: bool = False) -> None:
        """``prefill_rule``: the run lengths no prompt run has (``split_rule``); ``decode_rule``:
        the row counts no decode run has; ``recompute_answers``: an answer's positions are computed
        again as prompt before they are published (decode rows are not prompt rows, and a model
        that rounds activations to int8 makes the difference whole tokens)."""
        self.session = session
        self.encoder = encoder
        self.prefill_rule = prefill_rule
        self.recompute_answers = recompute_answers
        self.slots = open_slots(session, max_batch, context_length, decode_rule)
        if not session.on_host:
            started = time.perf_counter()
            self.slots.warm_up()
            if encoder is not None:
                encoder.warm_up()
            log.info("on %s: every device operation of the K/V slots%s ran once (kernels compiled) in %.2f s",
                     session.device_name, " and the encoder" if encoder is not None else "",
                     time.perf_counter() - started)
        self.kv = kv
        self.pace = pace
        """Measured prefill cost, observed after every chunk (how long computing a run would take)."""
        self.lifecycle = Lifecycle(self.slots.release, self._save_answer, shares)
        self.stats = self.lifecycle.stats

    def _save_answer(self, seq: Sequence) -> None:
        """Publishes what ``seq`` decoded (``KVTransfer.save_answer``), its positions first computed
        again as prompt where ``recompute_answers``: the cost of one prefill of the answer, paid
        once where every replica's next turn would otherwise pay it."""
        end = self.kv.answer_end(seq) if self.recompute_answers else None
        if end is not None:
            start = len(seq.prompt)
            self.lifecycle.deliver()  # the answer's last message goes out before this extra run
            try:
                self.run_prompt(seq.slot, [*seq.prompt, *seq.tokens], start, end - start, False)
            except Exception:  # noqa: BLE001 - the answer was delivered; only its publish is lost
                log.exception("computing the answer of request %s again for its publish failed", seq.request_id)
                return
            self.stats.recomputed_answer_tokens += end - start
        self.kv.save_answer(seq, self.slots)

    def prefault(self, tokens: int) -> int:
        """Faults in the slot memory the first request will use (``SlotBank.prefault``); safe on
        any thread, beside running steps. Returns the bytes faulted in."""
        return self.slots.prefault(tokens)

    def acquire(self, tokens: int) -> Slot:
        """A free slot for a sequence of at most ``tokens`` tokens (the scheduler checked one is free)."""
        return self.slots.acquire(tokens)

    def receiver(self, seq: Sequence) -> Callable[[int, np.ndarray], bool] | None:
        """Copies block i of a lookup into ``seq``'s slot as it arrives (``SlotBank.receiver``)."""
        return self.slots.receiver(seq.slot)

    def encoder_for(self, seq: Sequence) -> Callable[[], np.ndarray] | None:
        """Runs the encoder on ``seq``'s input: its cross K/V in the model's K/V dtype; None for a
        decoder-only model. Called on the KV connector's encoder thread, never on this one (the
        session is the runner's all the same: nothing else runs it)."""
        if seq.encoder_input is None:
            return None

        def encode() -> np.ndarray:
            cross = self.encoder.run(seq.encoder_input).astype(self.session.kv_dtype, copy=False)
            if not np.isfinite(cross).all():  # finite input, overflowing output: the values are the client's
                raise InvalidRequest("encoder_features", "the encoder's output overflows for these values; they lie "
                                     f"far outside what the model takes (largest magnitude {np.abs(seq.encoder_input).max():.3g})")
            return cross

        return encode

    def execute(self, plan: StepPlan) -> None:
        """Copies shared prefixes, runs the decode batch, then the prefill chunks; each finished
        run's tokens go out at once."""
        life = self.lifecycle
        for seq in plan.assemble:
            try:
                self._assemble(seq)
            except InvalidRequest as exc:  # the client's input (its encoding overflowed): its status says so
                life.fail_all([seq], exc)
            except Exception as exc:  # noqa: BLE001
                log.exception("assembling the cached prompt failed for request %s", seq.request_id)
                life.fail_all([seq], exc)
        for seq, row, tokens in plan.share:
            try:
                self._share(seq, row, tokens)
            except Exception as exc:  # noqa: BLE001
                log.exception("copying a shared prefix failed for request %s", seq.request_id)
                life.fail_all([seq], exc)
        for seq, ahead in plan.adopt:
            try:
                self.stats.adopted_tokens += self.kv.adopt(seq, ahead, self.slots)
            except Exception as exc:  # noqa: BLE001
                log.exception("copying blocks published meanwhile failed for request %s", seq.request_id)
                life.fail_all([seq], exc)
        life.deliver()  # what failed above reaches its consumer now, not after this step's runs
        if plan.decode:
            try:
                logits = self.slots.decode([s.slot for s in plan.decode], [s.next_token for s in plan.decode])
            except Exception as exc:  # noqa: BLE001 - a failed run fails its rows; the worker keeps serving
                log.exception("decode step failed for %d sequences", len(plan.decode))
                life.fail_all(plan.decode, exc)
            else:
                self.stats.decode_steps += 1
                self.stats.decode_rows += len(plan.decode)
                self.stats.max_decode_rows = max(self.stats.max_decode_rows, len(plan.decode))
                self._sample(plan.decode, logits)
            life.deliver()
        for seq, n in plan.prefill:
            if seq.done:  # failed above: its cross K/V or cached blocks never reached its slot
                continue
            try:
                logits = self._prefill(seq, n)
                if logits is not None and not np.isfinite(logits).all():
                    self._non_finite(seq)
                elif logits is not None:
                    rows = self._fork(seq)
                    self._sample(rows, np.broadcast_to(logits, (len(rows), logits.shape[-1])))
            except Exception as exc:  # noqa: BLE001
                log.exception("prefill failed for request %s", seq.request_id)
                life.fail_all([seq], exc)
            life.deliver()

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
        """Puts the sequence's cached blocks (and cross K/V, found or encoded before the sequence
        left its fetch) into its slot, once."""
        if seq.assembled or seq.done:
            return
        self.kv.load(seq, self.slots)
        seq.assembled = True

    def _share(self, seq: Sequence, row: Sequence, tokens: int) -> None:
        """Copies ``row``'s first ``tokens`` tokens into ``seq``'s slot (both hold the same prompt
        up to there), after ``seq``'s own cached blocks."""
        if seq.done or row.done:
            return
        t = time.perf_counter()
        self._assemble(seq)
        self.stats.shared_tokens += self.kv.share(seq, row, tokens, self.slots, t)

    def _prefill(self, seq: Sequence, n: int) -> np.ndarray | None:
        """Runs the next ``n`` prompt tokens of ``seq``; the logits once the prompt is done, else None."""
        t = time.perf_counter()
        self._assemble(seq)
        t_run = time.perf_counter()
        start = seq.prefilled
        if seq.prompt_logprobs is None:
            logits = self.run_prompt(seq.slot, seq.prompt, start, n, False)
        else:
            positions = self.run_prompt(seq.slot, seq.prompt, start, n, True)
            # Position j predicts prompt token start + j + 1; the prompt's last position predicts
            # the first generated token instead.
            predicted = seq.prompt[start + 1 : start + n + 1]
            seq.prompt_logprobs += token_logprobs(positions[: len(predicted)], predicted, seq.top_logprobs)
            logits = positions[-1]
        seq.prefilled += n
        end = time.perf_counter()
        self.stats.prefill_runs += 1
        self.stats.prefill_tokens += n
        seq.timings.prefill_ms += (end - t) * 1e3
        run_ms = (end - t_run) * 1e3
        if n >= MIN_PACE_TOKENS:  # a chunk of a few tokens costs its fixed overhead, not its tokens
            self.pace.observe(n, run_ms)
        self.kv.chunk_done(seq, self.slots, n, run_ms, bool(np.isfinite(logits).all()))
        return logits if seq.prefilled == len(seq.prompt) else None

    def run_prompt(self, slot: Slot, prompt: list[int], start: int, n: int, all_positions: bool) -> np.ndarray:
        """Computes positions ``start .. start + n - 1`` of ``prompt`` into ``slot`` (which holds
        ``start``) in the runs ``prefill_rule`` allows (one may begin a position early: it is
        computed again in place): the last position's logits, or with ``all_positions`` those of
        the n positions."""
        parts = []
        for begin, end in self.prefill_rule.runs(start, n):
            if begin < slot.length:
                self.slots.rewind(slot, begin)
            out = self.slots.prefill(slot, prompt[begin:end], all_positions=all_positions)
            parts.append(out[start - begin :] if all_positions and begin < start else out)
        return np.concatenate(parts) if all_positions and len(parts) > 1 else parts[-1]

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
                    self.lifecycle.fail_all([seq], exc)
                    continue
            self.lifecycle.emit(seq, int(tokens[i]), logits[i])
        for group, rows in searches.values():
            try:
                self._beam_step(group, logits[rows], bool(finite[rows].all()))
            except Exception as exc:  # noqa: BLE001 - one search's failure must not end the other rows
                log.exception("beam search step failed for request %s", group.rows[0].request_id)
                self.lifecycle.fail_all(group.rows, exc)

    def _beam_step(self, group: SequenceGroup, logits: np.ndarray, finite: bool) -> None:
        """One step of a beam search over its rows' logits ``[num_beams, vocab]`` (rows in group
        order): keeps the best continuations, reorders the rows' K/V by parent, and when the
        search is done sends the best hypotheses out on the first ``group.outputs`` rows."""
        rows, state, life = group.rows, group.beams, self.lifecycle
        if not finite:
            life.fail_all(rows, NumericalError(
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
            life.touch(row)
        with life.cond:
            self.stats.finished += 1
            for row in rows:
                life.finish(row)

    def _non_finite(self, seq: Sequence) -> None:
        """NaN or infinite logits. At the first token over K/V from elsewhere, that K/V is the
        suspect: the connector drops it and the prompt is computed again from its first token (the
        client has seen nothing yet), after the encoder input is encoded again on the encoder
        thread, the row fetching meanwhile. Otherwise the model itself failed: this request fails."""
        if seq.generated == 0 and self.kv.distrust(seq):
            seq.assembled = False
            encode = self.encoder_for(seq)
            if encode is not None:  # its cross K/V is computed again first, off this thread
                seq.phase = Phase.FETCHING
                self.kv.encode(seq, encode).add_done_callback(lambda _: self.lifecycle.fetched(seq))
            return
        self.lifecycle.fail_all([seq], NumericalError(
            f"the model produced NaN or infinite logits at generated token {seq.generated + 1}; "
            "nothing was sent from them"))
