"""What a generation request and its results look like to the engine (no gRPC types here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from services.engine.encoder_input import EncoderRequest
from services.engine.sampling import SamplingConfig
from services.engine.stop_matcher import StopMatcher
from services.runtime.chat_template import Message


class FinishReason(Enum):
    LENGTH = "length"
    STOP = "stop"
    """A stop string or a stop token id (the chunk's ``matched_stop`` says which)."""
    EOS = "eos"
    ABORT = "abort"
    """The worker ended the stream after sending tokens (shutting down, or the client stopped reading)."""


@dataclass(frozen=True, slots=True)
class BeamSearch:
    """Beam search settings (the proto's GenerateRequest.num_beams, length_penalty, early_stopping)."""

    num_beams: int = 1
    """1: no beam search."""
    length_penalty: float = 1.0
    early_stopping: bool = False

    @property
    def on(self) -> bool:
        return self.num_beams > 1


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str = ""


@dataclass(slots=True)
class TokenLogprob:
    """One position: the chosen (or prompt) token's log-probability under the raw logits, and the
    most likely alternatives (most likely first) when top_logprobs was asked for."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
    text: str = ""
    """The token decoded alone (special tokens decode to ""), filled by ``logprobs.with_text``."""


@dataclass(frozen=True, slots=True)
class CacheControl:
    """Per-request use of the shared prefix cache."""

    skip_read: bool = False
    skip_write: bool = False
    salt: str = ""


@dataclass(slots=True)
class GenerationRequest:
    """One request as the engine sees it. Exactly one of ``prompt`` / ``prompt_token_ids`` / ``messages``."""

    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    messages: list[Message] | None = None
    """A conversation for the folder's chat template (with the generation prompt)."""
    max_new_tokens: int = 16
    """0: as many as fit, up to the context's end and the worker's cap (``PreparedRequest``)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""
    encoder: EncoderRequest = field(default_factory=EncoderRequest)
    cache: CacheControl = field(default_factory=CacheControl)
    tenant: str = ""
    """The caller's tenant, from its authenticated credentials (never from a request field); it
    enters the cache namespace, so tenants never share blocks."""
    client: str = ""
    """Whose share the request counts against (``fair_share.client_of``: its tenant, else its
    address); "" for in-process callers."""
    deadline: float | None = None
    """``time.monotonic()`` at which the caller stops waiting (its gRPC deadline); None: never. A
    request still queued when its own prompt could no longer be prefilled by then is refused
    ``Overloaded`` rather than left to end DEADLINE_EXCEEDED (``Scheduler``)."""
    return_logits: bool = False
    """Attach each generated position's logits to the chunks (engine-level checks; not in the API)."""
    min_new_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    n: int = 1
    """Independent samples; sample i is seeded with ``sampling.seed + i``."""
    beams: BeamSearch = field(default_factory=BeamSearch)
    suppress_token_ids: Sequence[int] | None = None
    """Ids never generated (-inf at every step). None: the model folder's default
    (``GenerationDefaults.suppress_tokens``); empty: none."""
    begin_suppress_token_ids: Sequence[int] | None = None
    """Ids masked at each row's first generated token only. None: the folder's default
    (``GenerationDefaults.begin_suppress_tokens``); empty: none."""

    @property
    def rows(self) -> int:
        """Sequences the request holds: its beams, else its samples."""
        return self.beams.num_beams if self.beams.on else self.n


@dataclass(slots=True)
class PreparedRequest:
    """A validated request: decoder prompt ids, for encoder-decoder models the encoder input, the
    automaton of its stop strings (None: no stop strings), and the ids it suppresses (int64, the
    folder's defaults resolved; shared read-only by its rows). ``max_new_tokens`` is the
    request's, or for a request that left it 0, what fits: the context after the prompt, at most
    the worker's cap."""

    ids: list[int]
    encoder_input: np.ndarray | None
    max_new_tokens: int
    stops: StopMatcher | None = None
    suppress: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    begin_suppress: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


@dataclass(slots=True)
class TokenizeRequest:
    """One of ``text`` / ``token_ids`` / ``messages``."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: list[Message] | None = None


@dataclass(slots=True)
class TokenizeResult:
    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    encoder_cache_hit: bool = False


@dataclass(slots=True)
class Timings:
    """Milliseconds from the moment the engine received the request."""

    time_to_first_token_ms: float = 0.0
    prefill_ms: float = 0.0
    cache_fetch_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(slots=True)
class GenerationChunk:
    """New tokens and their text; the last chunk of a stream also carries finish, usage, timings."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    logits: list[np.ndarray] = field(default_factory=list)
    """With ``GenerationRequest.return_logits``: float32 ``[vocab]`` per token of ``token_ids``."""
    index: int = 0
    """The sample (or, with beam search, the hypothesis' rank) these tokens belong to."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """With ``GenerationRequest.logprobs``: one per token of ``token_ids``."""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """With ``GenerationRequest.prompt_logprobs``, on sample 0's first chunks, at most
    ``PROMPT_LOGPROBS_PER_CHUNK`` each: together one per prompt token after the first."""
    matched_stop: str | int | None = None
    """With finish reason STOP: the stop string (str) or stop token id (int) that matched."""
    beam_score: float | None = None
    """Beam search, on the final chunk: the hypothesis' length-normalised score."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the engine tells its request observers (metrics) once per request that ends."""

    request_id: str
    outcome: str
    """The finish reason's value, or "cancelled or failed"."""
    total_s: float
    """Seconds from receiving the request to its end."""
    usage: Usage
    timings: Timings
    read_cache: bool
    """Whether the prompt was looked up in the prefix cache (its tokens count as queries)."""
    fetch_skipped: bool
    """Whether the prompt's cached blocks were computed rather than fetched, computing being
    expected faster (``--prefix-fetch auto``, on a device)."""
    token_times: list[float]
    """perf_counter() at which each generated token was sampled (the inter-token gaps)."""
