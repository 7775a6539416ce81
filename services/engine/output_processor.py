"""The output processor: a request's rows drained into chunks of text for its stream.

Runs on the request's event loop. Each chunk holds every token one row made since its previous
chunk: a client that reads slower than tokens are made gets fewer, larger messages, and past
``max_unread_tokens`` the row pauses in the scheduler rather than buffering without bound. Text is
detokenized incrementally (``TextStream``), stop strings are matched on it (a match ends the row
here, and the scheduler frees its slot), and thousands of prompt log-probabilities are given text
on a tokenizer thread, never on the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from services.engine.generation import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    RequestRecord,
)
from services.engine.logprobs import with_text
from services.engine.off_loop import OffLoop
from services.engine.sequence import OutItem, Sequence
from services.engine.stop_matcher import StopMatcher
from services.engine.text_stream import TextStream
from services.errors import Overloaded
from services.runtime.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
PROMPT_LOGPROBS_PER_CHUNK = 64
"""Prompt log-probabilities per chunk: with 20 alternatives each, about 20 KB a message."""
TOKEN_BYTES = 8
"""Bytes one generated token adds to a stream's messages, about: its id and its text."""
LOGPROB_BYTES = 20
"""Bytes one log-probability adds (id, value, text), the chosen token's and each alternative's."""


def unread_limit(max_tokens: int, max_bytes: int, logprobs: bool, top_logprobs: int) -> int:
    """Tokens a consumer may leave unread before its row pauses: ``max_tokens``, or fewer where
    their messages would exceed ``max_bytes`` (a token with 20 alternatives is ~50x a plain one)."""
    per_token = TOKEN_BYTES + (LOGPROB_BYTES * (1 + top_logprobs) if logprobs else 0)
    return max(1, min(max_tokens, max_bytes // per_token))


class RowControl(Protocol):
    """What the stream tells the scheduler about its rows."""

    def abort(self, rows: list[Sequence], stopped: bool = False) -> None: ...

    def wake(self) -> None: ...


@dataclass(slots=True)
class StreamEnd:
    """How a stream ended: ``finish`` of its last row, and whether every row it sent ended."""

    finish: FinishReason | None = None
    complete: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: TextTokenizer, off_loop: OffLoop) -> None:
        self.tokenizer = tokenizer
        self._off_loop = off_loop

    async def stream(self, request: GenerationRequest, rows: list[Sequence], stops: StopMatcher | None,
                     control: RowControl, ended: StreamEnd) -> AsyncIterator[GenerationChunk]:
        """Yields chunks until every row whose output reaches the client (every sample, or the
        first n beams) has ended, noting how in ``ended``; a row's error is raised when reached."""
        outputs = rows[: rows[0].group.outputs] if rows[0].group is not None else rows
        texts = {id(seq): TextStream(self.tokenizer, stops or (), request.include_stop_str_in_output)
                 for seq in outputs}
        ready = rows[0].ready
        open_rows = list(outputs)
        while open_rows:
            await ready.wait()
            ready.clear()
            for seq in list(open_rows):
                items = seq.drain()
                if not items:
                    continue
                pieces = []
                if seq.prompt_logprobs and not seq.usage.completion_tokens:
                    # Thousands of positions x 20 alternatives to decode: not on the loop.
                    entries = await self._off_loop.run(lambda e: with_text(e, self.tokenizer), seq.prompt_logprobs,
                                                       seq.client)
                    pieces = [entries[i : i + PROMPT_LOGPROBS_PER_CHUNK]
                              for i in range(0, len(entries), PROMPT_LOGPROBS_PER_CHUNK)]
                    for piece in pieces[:-1]:  # ahead of the first token; the last rides with it
                        yield GenerationChunk([], "", index=seq.index, prompt_logprobs=piece)
                chunk = self._chunk(seq, items, texts[id(seq)], request)
                if pieces:
                    chunk.prompt_logprobs = pieces[-1]
                if len(items) >= seq.unread_limit:
                    control.wake()  # it may have paused this sequence: it can decode again
                if chunk.finish_reason is not None:
                    ended.finish = chunk.finish_reason
                    open_rows.remove(seq)
                    ended.complete = not open_rows
                    # A stop string ends it here, not in the scheduler (which ended it already otherwise).
                    control.abort([seq], stopped=chunk.finish_reason is FinishReason.STOP)
                yield chunk

    def _chunk(self, seq: Sequence, items: list[OutItem], text: TextStream,
               request: GenerationRequest) -> GenerationChunk:
        """Turns one sequence's drained tokens into one chunk: text deltas, log-probabilities, and
        the finish reason once the scheduler (EOS, stop token, length) or a stop string ends it.
        Raises a failed sequence's error, except that a stream the worker gave up on after tokens
        went out (shutting down, client not reading) ends with ABORT: what was sent stays valid."""
        tokens: list[int] = []
        logprobs = []
        delta, reason, matched = "", None, None
        sent = seq.usage.completion_tokens
        logits = seq.logits[sent : sent + len(items)] if seq.return_logits else []
        for i, item in enumerate(items):
            if isinstance(item, BaseException):
                if isinstance(item, Overloaded) and (tokens or sent):
                    reason = FinishReason.ABORT
                    break
                if not tokens:
                    raise item
                # Send the tokens made before the error first; the error ends the stream next.
                seq.outbox.extendleft(reversed(items[i:]))
                seq.ready.set()
                break
            token, reason, logprob = item
            tokens.append(token)
            if logprob is not None:
                logprobs.append(logprob)
            seq.usage.completion_tokens += 1
            if reason is FinishReason.STOP:  # a stop token id: its text only on request
                matched = token
                if request.include_stop_str_in_output:
                    delta += text.push(token)
            else:
                delta += text.push(token, armed=seq.usage.completion_tokens >= request.min_new_tokens)
            if text.stopped:
                reason, matched = FinishReason.STOP, text.matched
            if reason is not None:
                break
        chunk = GenerationChunk(tokens, delta, logits=logits[: len(tokens)], index=seq.index,
                                logprobs=with_text(logprobs, self.tokenizer))
        if reason is None:
            return chunk
        chunk.text += text.finish()
        if text.stopped:  # a stop string hidden behind an unfinished character until now
            reason, matched = FinishReason.STOP, text.matched
        seq.timings.total_ms = (time.perf_counter() - seq.t0) * 1e3
        chunk.finish_reason, chunk.usage, chunk.timings = reason, seq.usage, seq.timings
        chunk.matched_stop, chunk.beam_score = matched, seq.beam_score
        return chunk

    @staticmethod
    def record(seq: Sequence, finish: FinishReason | None) -> RequestRecord:
        """One line per request that reached the scheduler (what it asked, what the cache gave, what
        it cost), and the same facts for the request observers (metrics). ``finish`` None: the
        stream was cancelled or failed."""
        u, t = seq.usage, seq.timings
        total_s = time.perf_counter() - seq.t0
        outcome = finish.value if finish is not None else "cancelled or failed"
        verb = "finished" if finish is not None else "stopped"
        log.info("request %s %s after %d generated tokens (%s)", seq.request_id, verb, u.completion_tokens, outcome,
                 extra={"fields": {
                     "request_id": seq.request_id, "outcome": outcome, "prompt_tokens": u.prompt_tokens,
                     "cached_prompt_tokens": u.cached_prompt_tokens, "completion_tokens": u.completion_tokens,
                     "ttft_ms": round(t.time_to_first_token_ms, 1), "fetch_ms": round(t.cache_fetch_ms, 1),
                     "prefill_ms": round(t.prefill_ms, 1), "fetch_skipped": seq.kv.fetch_skipped,
                     "total_ms": round(total_s * 1e3, 1),
                     **({"encoder_cache_hit": u.encoder_cache_hit} if seq.encoder_input is not None else {}),
                 }})
        kv = seq.kv  # a skipped fetch looked nothing up: its tokens are no queries
        return RequestRecord(seq.request_id, outcome, total_s, u, t, not (kv.cache.skip_read or kv.fetch_skipped),
                             kv.fetch_skipped, seq.token_times)
