"""One request's life inside a worker, as data: its phase, its slot, and the tokens on their way out.

A sequence moves ``QUEUED → FETCHING → PREFILLING → DECODING → FINISHED`` (any phase can jump to
FINISHED when its consumer goes away). The rows of a request with several samples or beams form a
``SequenceGroup``: its leader alone fetches and prefills; the others go ``QUEUED → WAITING`` and
receive a copy of the leader's K/V when its prompt is done, then decode as rows of their own. The
scheduler thread owns every field except the ones the consumer (the request's coroutine on the
event loop) touches: it drains ``outbox`` and sets ``aborted`` through the scheduler. Where the
prompt's K/V comes from and goes to is the KV connector's, in ``kv``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from services.engine.beam_search import BeamState
from services.engine.generation import FinishReason, Timings, TokenLogprob, Usage
from services.engine.kv_connector.state import SequenceKV
from services.engine.penalties import LogitsAdjuster
from services.engine.sampling import Sampler
from services.runtime.slots import Slot


class Phase(Enum):
    QUEUED = "queued"
    """Admitted; waiting for a free slot."""
    FETCHING = "fetching"
    """Holds a slot; its store lookup runs on a read thread (and, for an encoder-decoder model on a
    cross K/V miss, its encoder run on the encoder thread)."""
    PREFILLING = "prefilling"
    """Its uncached prompt runs on its own row, in chunks under the per-step token budget."""
    WAITING = "waiting"
    """A follower of a group: holds a slot, waits for its leader's prompt to be copied in."""
    DECODING = "decoding"
    """Advances one token per step in the shared decode batch."""
    FINISHED = "finished"
    """Done, cancelled or failed; its slot is free again."""


OutItem = tuple[int, FinishReason | None, TokenLogprob | None] | BaseException
"""What the consumer drains: a token with the reason it ended the sequence (None: more follow) and
its log-probability when asked for, or the error that ended it."""


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """The rows of one request with n samples or beams; ``rows[0]`` is the leader."""

    rows: list[Sequence]
    beams: BeamState | None = None
    outputs: int = 1
    """Rows whose output reaches the client: every sample, or the first n beams (which carry the
    n best hypotheses at the end)."""


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    eos_ids: frozenset[int]
    """The model's EOS ids (empty when the request ignores EOS): they end the sequence with EOS."""
    stop_ids: frozenset[int]
    """The request's stop token ids: they end the sequence with STOP."""
    t0: float
    """perf_counter() when the engine received the request; timings are measured from it."""
    loop: asyncio.AbstractEventLoop
    kv: SequenceKV
    """What the KV connector keeps of this row: keys, lookup, leases, publishes (``kv_connector.state``)."""
    encoder_input: np.ndarray | None = None
    return_logits: bool = False
    """Keep each sampled position's logits (float32 ``[vocab]``) in ``logits``; for checks."""
    adjust: LogitsAdjuster | None = None
    """Penalties and the min_new_tokens stop mask (None: the raw logits are sampled)."""
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    """Filled while the prompt runs when the request asked for prompt log-probabilities."""
    group: SequenceGroup | None = None
    index: int = 0
    """The row's place in its group (the sample's index)."""
    tokens: list[int] = field(default_factory=list)
    """Tokens generated so far (beams keep theirs in ``BeamState``)."""
    beam_score: float | None = None
    client: str = ""
    """Who sent the request (``fair_share.client_of``): the share its rows count against."""
    deadline: float | None = None
    """``time.monotonic()`` at which its caller stops waiting (``GenerationRequest.deadline``)."""
    unread_limit: int = 256
    """Tokens the consumer may leave unread before the row pauses (``output_processor.unread_limit``)."""
    stream_interval: int = 1
    """Tokens made before the consumer is woken (at most half ``unread_limit``, so a paused row has
    always woken it; 1 with stop strings, which the consumer matches); the first token, the row's
    end and a token held ``lifecycle.MAX_HOLD_S`` wake it at once (``SchedulerOptions.stream_interval``)."""
    held_since: float | None = None
    """perf_counter() of the oldest token in ``outbox`` its consumer has not been woken for."""
    passed_by: int = 0
    """Requests admitted ahead of this one while it waited at the head of the queue for slots."""
    phase: Phase = Phase.QUEUED
    slot: Slot | None = None
    prefilled: int = 0
    """Prompt tokens whose K/V the slot holds (or will, once the cached blocks are copied in)."""
    assembled: bool = False
    """Whether the cached blocks (and cross K/V) are in the slot yet."""
    next_token: int = -1
    """The last sampled token, fed at the next decode step."""
    generated: int = 0
    aborted: bool = False
    stopped: bool = False
    """Set with ``aborted`` when the consumer ended the sequence at a stop string: it finished
    normally, so its answer is published when its slot is freed."""
    paused: bool = False
    """Skipped by decode steps because the consumer has ``unread_limit`` tokens still to read."""
    paused_since: float = 0.0
    """time.monotonic() when the sequence last paused."""
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    outbox: deque[OutItem] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (on the consumer's loop) when ``outbox`` has something new."""
    logits: list[np.ndarray] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    """perf_counter() at which each generated token was sampled (the metrics' inter-token gaps)."""

    @property
    def done(self) -> bool:
        return self.phase is Phase.FINISHED

    def ended_by(self, token: int) -> FinishReason | None:
        """STOP for one of the request's stop token ids (even when it is also EOS), EOS for the
        model's end-of-sequence token, else None."""
        if token in self.stop_ids:
            return FinishReason.STOP
        if token in self.eos_ids:
            return FinishReason.EOS
        return None

    @property
    def rows(self) -> list[Sequence]:
        """The sequences of this request: its group's rows, or itself."""
        return self.group.rows if self.group is not None else [self]

    def drain(self) -> list[OutItem]:
        """Everything queued for the consumer so far (consumer side)."""
        items = []
        while self.outbox:
            items.append(self.outbox.popleft())
        return items
