"""The input processor: a request checked, tokenized and turned into the rows the scheduler runs.

Sizes are checked first, on the event loop (``RequestLimits``: O(request size), so an oversized
request is refused at once); everything else (the fields, the chat template, tokenizing, the
encoder input, the stop automaton) runs on the tokenizer threads (``OffLoop``). Every refusal names
the field and what would be accepted (``InvalidRequest``, ``RequestOutOfRange``,
``FailedPrecondition``). Reads the sessions' I/O contract (what the encoder takes, whether the
decoder emits every position's logits), never runs them.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TypeVar

import numpy as np

from services.engine.beam_search import BeamState
from services.engine.encoder_input import encoder_array
from services.engine.generation import (
    CacheControl,
    GenerationRequest,
    PreparedRequest,
    TokenizeRequest,
    TokenizeResult,
    Usage,
)
from services.engine.kv_connector.state import SequenceKV
from services.engine.logprobs import MAX_TOP_LOGPROBS
from services.engine.off_loop import OffLoop
from services.engine.output_processor import unread_limit
from services.engine.penalties import LogitsAdjuster
from services.engine.request_limits import MAX_STOP_TOKEN_IDS, MAX_SUPPRESS_TOKEN_IDS, RequestLimits
from services.engine.sampling import Sampler
from services.engine.sequence import Sequence, SequenceGroup
from services.engine.stop_matcher import StopMatcher
from services.errors import FailedPrecondition, InvalidRequest, RequestOutOfRange
from services.runtime.chat_template import (
    BrokenChatTemplate,
    ChatTemplate,
    ChatTemplateError,
    Message,
)
from services.runtime.generation_config import GenerationDefaults
from services.runtime.model_spec import ModelSpec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.onnx_encoder import EncoderSession
from services.runtime.tokenizer import TextTokenizer, TooManyTokens

R = TypeVar("R")
SUPPRESS_FIELDS = ("suppress_token_ids", "begin_suppress_token_ids")


class InputProcessor:
    def __init__(self, spec: ModelSpec, decoder: DecoderSession, encoder: EncoderSession | None,
                 tokenizer: TextTokenizer, limits: RequestLimits, max_new_tokens_cap: int, max_rows: int,
                 off_loop: OffLoop, audio_loop: OffLoop, unread: tuple[int, int] = (256, 64 * 1024),
                 stream_interval: int = 1) -> None:
        self.spec = spec
        self._decoder = decoder
        self._encoder = encoder
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_new_tokens_cap = max_new_tokens_cap
        self.max_rows = max_rows
        """Rows one request may hold (n samples, beams): the worker's batch."""
        self.unread = unread
        """(tokens, bytes) a consumer may leave unread before its row pauses (``unread_limit``)."""
        self.stream_interval = stream_interval
        """Tokens made before a row's consumer is woken (``SchedulerOptions.stream_interval``)."""
        self._off_loop = off_loop
        self._audio_loop = audio_loop
        """Where a request with audio is prepared instead: decoding it never delays text requests."""
        self.chat_template: ChatTemplate | None = None
        """The folder's chat template (set by ``Engine.load``), for requests given as messages."""
        self.generation_defaults = GenerationDefaults()
        """The folder's generation_config.json defaults (set by ``Engine.load``), for requests that
        leave suppress_token_ids or begin_suppress_token_ids unset."""

    async def prepare_async(self, request: GenerationRequest) -> PreparedRequest:
        """``prepare`` in two parts: the size checks on the event loop (an oversized request is
        refused at once, not after waiting behind other requests' tokenizing), the rest on a
        tokenizer thread."""
        self.limits.check_generation(request)
        return await (self._audio_loop if request.encoder.audio else self._off_loop).run(self.tokenized, request,
                                                                                         request.client)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validates and tokenizes ``request``; raises InvalidRequest (or RequestOutOfRange) naming
        the field."""
        self.limits.check_generation(request)
        return self.tokenized(request)

    def tokenized(self, request: GenerationRequest) -> PreparedRequest:
        """Everything of ``prepare`` after the size checks: the cheap checks first, then the work
        (rendering, tokenizing, the encoder input, the stop automaton)."""
        self._check_generation_fields(request)
        suppress, begin_suppress = self._suppressed(request)
        encoder_input = encoder_array(request.encoder, self.spec, self.tokenizer, self._encoder)
        if encoder_input is not None and not request.prompt_token_ids and not request.messages and (
                not request.prompt or self.generation_defaults.previous_text_token is not None):
            ids = self._start_sequence(request)
        else:
            ids = self._prompt_ids(request)
        max_new_tokens = request.max_new_tokens or min(self.max_new_tokens_cap, self.spec.context_length - len(ids))
        if len(ids) + max(1, request.max_new_tokens) > self.spec.context_length:
            raise self._beyond_context(request, len(ids))
        if request.min_new_tokens > max_new_tokens:
            raise InvalidRequest("min_new_tokens", f"must not exceed max_new_tokens ({max_new_tokens}"
                                 f"{'' if request.max_new_tokens else ', what fits after the prompt'}), "
                                 f"got {request.min_new_tokens}")
        return PreparedRequest(ids, encoder_input, max_new_tokens, StopMatcher(request.stop) if request.stop else None,
                               suppress, begin_suppress)

    def render_chat(self, messages: list[Message]) -> str:
        """The prompt text of ``messages`` by the folder's chat template, generation prompt added."""
        if self.chat_template is None:
            raise FailedPrecondition(f"model {self.spec.name} has no chat template (tokenizer_config.json "
                                     "chat_template): send prompt or prompt_token_ids")
        try:
            return self.chat_template.render(messages)
        except ChatTemplateError as exc:
            raise InvalidRequest("messages", str(exc)) from exc
        except BrokenChatTemplate as exc:
            raise FailedPrecondition(str(exc)) from exc

    async def tokenize(self, request: TokenizeRequest, shape: Callable[[TokenizeResult], R], on: OffLoop,
                       client: str = "") -> R:
        """The Tokenize call: text or messages to ids, or ids to text; returns ``shape(result)``.
        Sizes are checked on the event loop; the rest, ``shape`` included, runs ``on`` a thread
        (the engine's Tokenize thread, never the requests' tokenizer threads): turning a million
        ids into the caller's message must not hold the loop."""
        self.limits.check_tokenize(request)
        return await on.run(lambda r: shape(self._tokenize(r)), request, client)

    def rows(self, request: GenerationRequest, prepared: PreparedRequest, t0: float,
             kv_states: Callable[[CacheControl, int], list[SequenceKV]]) -> list[Sequence]:
        """The request's sequences: one, or a group of n samples (sample i seeded ``seed + i``) or
        num_beams beams sharing one event that wakes the consumer. ``kv_states(cache, rows)`` gives
        the KV connector's state of each row; ``t0`` is when the request came (perf_counter)."""
        beams = request.beams
        count = request.rows
        # Prompt log-probabilities need logits where the prompt is computed: nothing is read.
        cache = replace(request.cache, skip_read=True) if request.prompt_logprobs else request.cache
        eos = frozenset() if request.ignore_eos else frozenset(self.spec.eos_token_ids)
        stop_ids = frozenset(request.stop_token_ids)
        request_id = request.request_id or uuid.uuid4().hex
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        unread = unread_limit(*self.unread, request.logprobs, request.top_logprobs)
        # Stop strings are matched where tokens are read: held tokens would be decoded past a stop.
        # Half the unread limit at most, so that a row is not paused at every message.
        interval = 1 if prepared.stops is not None else max(1, min(self.stream_interval, unread // 2))
        rows = []
        for i, kv in enumerate(kv_states(cache, count)):
            sampling = request.sampling
            if sampling.seed is not None and i:
                sampling = replace(sampling, seed=(sampling.seed + i) % 2**64)
            adjust = None
            if LogitsAdjuster.needed(sampling, request.min_new_tokens, prepared.suppress, prepared.begin_suppress):
                adjust = LogitsAdjuster(sampling, prepared.ids, self.spec.vocab_size, eos | stop_ids, request.min_new_tokens,
                                        prepared.suppress, prepared.begin_suppress)
            rows.append(Sequence(
                request_id=request_id,
                prompt=prepared.ids,
                max_new_tokens=prepared.max_new_tokens,
                sampler=Sampler(sampling),
                eos_ids=eos,
                stop_ids=stop_ids,
                t0=t0,
                loop=loop,
                kv=kv,
                encoder_input=prepared.encoder_input,
                return_logits=request.return_logits,
                usage=Usage(prompt_tokens=len(prepared.ids)),
                adjust=adjust,
                logprobs=request.logprobs,
                top_logprobs=request.top_logprobs,
                prompt_logprobs=[] if request.prompt_logprobs and i == 0 else None,
                index=i,
                ready=ready,
                client=request.client,
                deadline=request.deadline,
                unread_limit=unread,
                stream_interval=interval,
            ))
        if count > 1:
            group = SequenceGroup(rows, BeamState(beams, eos | stop_ids) if beams.on else None,
                                  outputs=request.n if beams.on else count)
            for seq in rows:
                seq.group = group
        return rows

    def _check_generation_fields(self, request: GenerationRequest) -> None:
        cap = self.max_new_tokens_cap
        if not 0 <= request.max_new_tokens <= cap:
            raise InvalidRequest("max_new_tokens", f"must be between 1 and {cap} (the worker's --max-new-tokens-cap; "
                                 f"unset: as many as fit), got {request.max_new_tokens}")
        s = request.sampling
        if not (math.isfinite(s.temperature) and s.temperature >= 0.0):
            raise InvalidRequest("sampling.temperature", f"must be a finite number >= 0 (0 = greedy), got {s.temperature}")
        if not 0.0 < s.top_p <= 1.0:
            raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
        if not 0.0 <= s.min_p <= 1.0:
            raise InvalidRequest("sampling.min_p", f"must be in [0, 1] (0 = off), got {s.min_p}")
        if not 0.01 <= s.repetition_penalty <= 100.0:  # beyond, logits overflow float32 (1e-38: every one inf)
            raise InvalidRequest("sampling.repetition_penalty", f"must be in [0.01, 100] (1 = off), got {s.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(s, name) <= 2.0:
                raise InvalidRequest(f"sampling.{name}", f"must be in [-2, 2] (0 = off), got {getattr(s, name)}")
        if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got more than {MAX_STOP_TOKEN_IDS}")
        self._checked_ids("stop_token_ids", request.stop_token_ids)
        for name in SUPPRESS_FIELDS:
            ids = getattr(request, name)
            if ids is not None and len(ids) > MAX_SUPPRESS_TOKEN_IDS:
                raise InvalidRequest(name, f"at most {MAX_SUPPRESS_TOKEN_IDS} ids, got more than {MAX_SUPPRESS_TOKEN_IDS}")
            self._checked_ids(name, ids or ())
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
        if request.top_logprobs and not (request.logprobs or request.prompt_logprobs):
            raise InvalidRequest("top_logprobs", "applies to logprobs or prompt_logprobs: set one of them")
        if request.prompt_logprobs and not self._decoder.logits_per_position:
            raise FailedPrecondition(f"model {self.spec.name}'s graph emits only the last position's logits: "
                                     "prompt_logprobs cannot be computed")
        self._check_rows(request)

    def _suppressed(self, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
        """The ids the request suppresses at every token and at the first one (int64), the
        folder's defaults where it leaves a field unset. Refuses masks that leave the first token
        no id to be (with beam search: fewer than num_beams ids that continue a beam), since its
        logits would then be all -inf (or a beam would continue on a masked id)."""
        defaults = self.generation_defaults
        suppress = defaults.suppress_tokens if request.suppress_token_ids is None else request.suppress_token_ids
        begin = defaults.begin_suppress_tokens if request.begin_suppress_token_ids is None else request.begin_suppress_token_ids
        if not suppress and not begin:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        blocked = {*suppress, *begin}
        ends_blocked = request.min_new_tokens > 0 or request.beams.on  # masked, or (beams) never continuing
        if ends_blocked:
            blocked.update(request.stop_token_ids)
            blocked.update(() if request.ignore_eos else self.spec.eos_token_ids)
        need = request.beams.num_beams if request.beams.on else 1
        if (left := self.spec.vocab_size - len(blocked)) < need:
            raise InvalidRequest(SUPPRESS_FIELDS[0], (
                f"the first token cannot be any of {len(blocked)} of the {self.spec.vocab_size} ids (suppress_token_ids "
                f"and begin_suppress_token_ids, the model folder's defaults where unset"
                f"{', the EOS and stop token ids' if ends_blocked else ''}): {left} left, at least {need} needed"))
        return np.asarray(suppress, dtype=np.int64), np.asarray(begin, dtype=np.int64)

    def _check_rows(self, request: GenerationRequest) -> None:
        """n samples and beam search: each row is a slot, so a request may hold at most the batch."""
        rows_cap = self.max_rows
        beams = request.beams
        if not 1 <= request.n <= rows_cap:
            raise InvalidRequest("n", f"must be between 1 and the worker's batch of {rows_cap} (--max-batch), got {request.n}")
        if not beams.on:
            return
        if beams.num_beams > rows_cap:
            raise InvalidRequest("num_beams", f"must not exceed the worker's batch of {rows_cap} (--max-batch), "
                                 f"got {beams.num_beams}")
        if request.n > beams.num_beams:
            raise InvalidRequest("n", f"returns the n best of num_beams hypotheses: must not exceed num_beams "
                                 f"({beams.num_beams}), got {request.n}")
        if not -10.0 <= beams.length_penalty <= 10.0:
            raise InvalidRequest("length_penalty", f"must be in [-10, 10] (1 = the mean log-probability), "
                                 f"got {beams.length_penalty}")
        s = request.sampling
        refused = [name for name, used in (
            ("sampling.temperature", not s.greedy), ("sampling.top_k", s.top_k), ("sampling.top_p", s.top_p < 1.0),
            ("sampling.min_p", s.min_p), ("stop", request.stop), ("logprobs", request.logprobs)) if used]
        if refused:
            raise InvalidRequest(refused[0], "beam search is deterministic and sends whole hypotheses at the end: "
                                 "temperature must be 0, and top_k, top_p, min_p, stop strings and logprobs unset")

    def _tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        if sum(map(bool, (request.text, request.token_ids, request.messages))) > 1:
            raise InvalidRequest("text", "set one of text, token_ids and messages")
        if request.messages:
            text = self.render_chat(request.messages)
            return TokenizeResult(self.tokenizer.encode(text), text)
        if request.token_ids:
            ids = self._checked_ids("token_ids", request.token_ids)
            return TokenizeResult(ids, self.tokenizer.decode(ids))
        return TokenizeResult(self.tokenizer.encode(request.text or ""), request.text or "")

    def _start_sequence(self, request: GenerationRequest) -> list[int]:
        """An encoder-decoder model's decoder prompt when the request gives no prompt ids: the
        folder's start sequence (else its decoder start token), after the prompt text as
        previous-text context where the folder has such a token (Whisper: ``<|startofprev|>`` and
        the text's last context_length / 2 - 1 tokens, a space before it, as faster-whisper; fewer
        where max_new_tokens needs the room)."""
        defaults = self.generation_defaults
        start = list(defaults.decoder_prompt) or [self.spec.decoder_start_token_id]
        if start[0] is None:
            raise InvalidRequest("prompt", f"model {self.spec.name} names no decoder start token: give a decoder prompt")
        if not request.prompt:
            return start
        # faster-whisper keeps the last context_length / 2 - 1 tokens; fewer where the request's
        # max_new_tokens would not fit beside them (it shortens its generation instead).
        room = self.spec.context_length - max(1, request.max_new_tokens) - len(start) - 1
        keep = min(self.spec.context_length // 2 - 1, room)
        context = self.tokenizer.encode(" " + request.prompt.strip())[-keep:] if keep > 0 else []
        return [defaults.previous_text_token, *context, *start]

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if sum(map(bool, (request.prompt, request.prompt_token_ids, request.messages))) > 1:
            raise InvalidRequest("prompt", "set one of prompt, prompt_token_ids and messages")
        # More tokens than this cannot run; they are counted, never turned into Python ints.
        room = self.spec.context_length - max(1, request.max_new_tokens)
        try:
            if request.messages:
                ids = self.tokenizer.encode(self.render_chat(request.messages), room)
            elif request.prompt_token_ids:
                ids = self._checked_ids("prompt_token_ids", request.prompt_token_ids)
            elif request.prompt:
                ids = self.tokenizer.encode(request.prompt, room)
            else:
                raise InvalidRequest("prompt", "no prompt: set prompt (text), prompt_token_ids or messages")
        except TooManyTokens as exc:
            raise self._beyond_context(request, exc.count) from None
        if not ids:
            raise InvalidRequest("prompt", "the prompt encodes to no tokens")
        return ids

    def _checked_ids(self, field: str, ids: Iterable[int]) -> list[int]:
        ids = list(ids)
        for i, t in enumerate(ids):
            if not 0 <= t < self.spec.vocab_size:
                raise InvalidRequest(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {self.spec.vocab_size})")
        return ids

    def _beyond_context(self, request: GenerationRequest, prompt_tokens: int) -> RequestOutOfRange:
        """The refusal of a request whose prompt of ``prompt_tokens`` does not fit the context with
        its max_new_tokens. It blames the prompt's field (``messages``, ``prompt_token_ids`` or
        ``prompt``) where the prompt alone leaves no room for one new token, since no max_new_tokens
        could help; else max_new_tokens, saying how many fit."""
        context = self.spec.context_length
        if prompt_tokens >= context:
            blamed = "messages" if request.messages else "prompt_token_ids" if request.prompt_token_ids else "prompt"
            return RequestOutOfRange(
                blamed, f"the prompt alone is {prompt_tokens} tokens; the context length of {context} tokens "
                        "must hold it and at least one new token: shorten the prompt")
        return RequestOutOfRange(
            "max_new_tokens",
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
            f"context length of {context} tokens: at most {context - prompt_tokens} new tokens fit",
        )
