"""The generation engine: validates a request, prefills the prompt, decodes token by token.

The engine knows models, tokens and (from the shared-cache issue on) a store interface; it knows
nothing of gRPC. Each ONNX step runs on a thread pool so the event loop keeps serving other
streams while one runs; the session is shared by all streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np
import onnxruntime as ort

from services.errors import InvalidRequest, RequestOutOfRange
from services.model_spec import ModelSpec, load_model_spec
from services.onnx_decoder import DecoderSession, KVCache
from services.sampling import Sampler, SamplingConfig
from services.text_stream import TextStream
from services.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


class FinishReason(Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"


@dataclass(slots=True)
class GenerationRequest:
    """One request as the engine sees it. Exactly one of ``prompt`` / ``prompt_token_ids``."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_new_tokens: int = 16
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""
    has_encoder_input: bool = False


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


@dataclass(slots=True)
class EngineStats:
    """Counters since start; read by tests and logs."""

    started: int = 0
    finished: int = 0
    cancelled: int = 0
    active: int = 0


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_new_tokens_cap: int = 4096
    block_size: int = 64


class Engine:
    def __init__(self, spec: ModelSpec, session: DecoderSession, tokenizer: TextTokenizer,
                 limits: EngineLimits, run_threads: int = 4) -> None:
        self.spec = spec
        self.session = session
        self.tokenizer = tokenizer
        self.limits = limits
        self.stats = EngineStats()
        self._executor = ThreadPoolExecutor(max_workers=run_threads, thread_name_prefix="onnx-run")

    @classmethod
    def load(cls, model_dir: Path, limits: EngineLimits, execution_provider: str = "auto",
             intra_op_threads: int = 0, run_threads: int = 4) -> Engine:
        spec = load_model_spec(model_dir)
        session = DecoderSession(spec, execution_provider, intra_op_threads)
        return cls(spec, session, TextTokenizer(model_dir / "tokenizer.json"), limits, run_threads)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Validates ``request`` and returns its prompt token ids; raises InvalidRequest."""
        if request.has_encoder_input:
            raise InvalidRequest("encoder_prompt", f"model {self.spec.name} is decoder-only and takes no encoder input")
        if request.prompt and request.prompt_token_ids:
            raise InvalidRequest("prompt", "set either prompt or prompt_token_ids, not both")
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            for i, t in enumerate(ids):
                if not 0 <= t < self.spec.vocab_size:
                    raise InvalidRequest(f"prompt_token_ids[{i}]", f"token id {t} is outside the vocabulary [0, {self.spec.vocab_size})")
        elif request.prompt:
            ids = self.tokenizer.encode(request.prompt)
        else:
            raise InvalidRequest("prompt", "no prompt: set prompt (text) or prompt_token_ids")
        if not ids:
            raise InvalidRequest("prompt", "the prompt encodes to no tokens")
        cap = self.limits.max_new_tokens_cap
        if not 1 <= request.max_new_tokens <= cap:
            raise InvalidRequest("max_new_tokens", f"must be between 1 and {cap}, got {request.max_new_tokens}")
        if len(ids) + request.max_new_tokens > self.spec.context_length:
            raise RequestOutOfRange(
                "max_new_tokens",
                f"prompt ({len(ids)} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
                f"context length of {self.spec.context_length} tokens",
            )
        s = request.sampling
        if not s.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequest("sampling.temperature", f"must be >= 0 (0 = greedy), got {s.temperature}")
        if not 0.0 < s.top_p <= 1.0:
            raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
        for i, stop in enumerate(request.stop):
            if not stop:
                raise InvalidRequest(f"stop[{i}]", "stop strings must not be empty")
        return ids

    async def _run(self, token_ids: list[int], cache: KVCache, run_options: ort.RunOptions) -> tuple[np.ndarray, KVCache]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.session.run, token_ids, cache, run_options)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Yields chunks until a stop condition; validation errors raise before the first chunk.

        Cancelling the consuming task stops generation at the current step: an ONNX run in flight
        is told to terminate, and the stream's buffers are released.
        """
        t0 = time.perf_counter()
        ids = self.prompt_ids(request)
        request_id = request.request_id or uuid.uuid4().hex
        self.stats.started += 1
        self.stats.active += 1
        run_options = ort.RunOptions()
        sampler = Sampler(request.sampling)
        text = TextStream(self.tokenizer, request.stop)
        usage = Usage(prompt_tokens=len(ids))
        timings = Timings()
        cache: KVCache | None = self.session.empty_cache()
        finished = False
        try:
            logits, cache = await self._run(ids, cache, run_options)
            timings.prefill_ms = (time.perf_counter() - t0) * 1e3
            while True:
                token = sampler(logits)
                usage.completion_tokens += 1
                if usage.completion_tokens == 1:
                    timings.time_to_first_token_ms = (time.perf_counter() - t0) * 1e3
                reason = None
                if token in self.spec.eos_token_ids and not request.ignore_eos:
                    reason = FinishReason.EOS
                delta = text.push(token)
                if text.stopped:
                    reason = FinishReason.STOP
                elif reason is None and usage.completion_tokens >= request.max_new_tokens:
                    reason = FinishReason.LENGTH
                if reason is None:
                    yield GenerationChunk([token], delta)
                    logits, cache = await self._run([token], cache, run_options)
                    continue
                delta += text.finish()
                timings.total_ms = (time.perf_counter() - t0) * 1e3
                finished = True
                yield GenerationChunk([token], delta, reason, usage, timings)
                return
        finally:
            # Reached on completion, on an error, and when the consumer is cancelled or goes away.
            run_options.terminate = True
            cache = None
            self.stats.active -= 1
            if finished:
                self.stats.finished += 1
            else:
                self.stats.cancelled += 1
                log.info("request %s stopped after %d generated tokens (cancelled or failed)",
                         request_id, usage.completion_tokens)
