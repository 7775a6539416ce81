"""The generation engine: validates a request, reuses its cached prefix, prefills the rest and
decodes token by token.

The engine knows models, tokens and a store interface; it knows nothing of gRPC. Store lookups
and publishes run on the store threads; each stream's token loop (assembling its past, prefill,
every decode step) runs on one run thread, so the event loop only moves chunks to the client. The
ONNX session is shared by all streams.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cachestore.cross import CrossStore
from cachestore.keys import BlockHash, Namespace, encoder_input_hash
from cachestore.prefix import CANONICAL_LAYOUT, KVGeometry, PrefixLookup, PrefixStore
from cachestore.stats import CacheStats
from cachestore.store import KVStore
from services.engine.encoder_input import encoder_array
from services.engine.generation import (
    CacheControl,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    PreparedRequest,
    Timings,
    Usage,
)
from services.engine.sampling import Sampler
from services.engine.text_stream import TextStream
from services.errors import InvalidRequest, RequestOutOfRange
from services.runtime.model_spec import ModelSpec, load_model_spec
from services.runtime.onnx_decoder import DecoderSession, KVCache
from services.runtime.onnx_encoder import EncoderSession
from services.runtime.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    """Counters since start; read by tests and logs."""

    started: int = 0
    finished: int = 0
    cancelled: int = 0
    active: int = 0
    publishes: int = 0


@dataclass(frozen=True, slots=True)
class EngineOptions:
    max_new_tokens_cap: int = 4096
    block_size: int = 64
    """Tokens per shared cache block."""
    run_threads: int = 16
    """Streams that can decode at once: each holds one run thread from prefill to its last token;
    more wait for a free thread."""
    store_threads: int = 4
    """Concurrent store lookups and publishes."""
    max_pending_publishes: int = 16
    """Publishes waiting for the store beyond this are dropped (counted), bounding memory."""
    max_value_bytes: int = 128 * 1024 * 1024
    """Cross-attention values larger than this are not stored (Redis caps a value at 512 MiB)."""


class Engine:
    def __init__(self, spec: ModelSpec, session: DecoderSession, tokenizer: TextTokenizer,
                 options: EngineOptions, store: KVStore, cache_stats: CacheStats,
                 encoder: EncoderSession | None = None) -> None:
        self.spec = spec
        self.session = session
        self.encoder = encoder
        self.cross = CrossStore(store, cache_stats, options.max_value_bytes)
        self.tokenizer = tokenizer
        self.options = options
        self.stats = EngineStats()
        self.cache_stats = cache_stats
        self.store = store
        self.prefix = PrefixStore(
            store, KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_size, session.kv_dtype), cache_stats
        )
        self._executor = ThreadPoolExecutor(max_workers=options.run_threads, thread_name_prefix="onnx-run")
        self._store_executor = ThreadPoolExecutor(max_workers=options.store_threads, thread_name_prefix="kv-store")
        self._pending_publishes: set[asyncio.Future] = set()

    @classmethod
    def load(cls, model_dir: Path, options: EngineOptions, store: KVStore, cache_stats: CacheStats,
             execution_provider: str = "auto", intra_op_threads: int = 0) -> Engine:
        spec = load_model_spec(model_dir)
        session = DecoderSession(spec, execution_provider, intra_op_threads)
        encoder = EncoderSession(spec, execution_provider, intra_op_threads) if spec.encoder else None
        return cls(spec, session, TextTokenizer(model_dir / "tokenizer.json"), options, store, cache_stats, encoder)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._store_executor.shutdown(wait=True)
        self.store.close()

    async def wait_for_publishes(self) -> None:
        """Returns once every publish scheduled so far has reached the store (or failed)."""
        if self._pending_publishes:
            await asyncio.gather(*list(self._pending_publishes), return_exceptions=True)

    def namespace(self, salt: str, encoder_input: BlockHash | None = None) -> Namespace:
        """Everything this worker's prefix K/V depends on besides the tokens (DESIGN invariant 2):
        for an encoder-decoder model also the encoder input, whose cross-attention feeds every
        decoder layer, so the same decoder prompt under another encoder input never hits."""
        return Namespace(
            model_fingerprint=self.spec.fingerprint,
            block_size=self.options.block_size,
            dtype=self.session.kv_dtype.name,
            layout=CANONICAL_LAYOUT,
            salt=salt,
            extra=encoder_input.hex() if encoder_input else "",
        )

    def encoder_input_hash(self, salt: str, array: np.ndarray) -> BlockHash:
        """Names an encoder input (and so its cross K/V) under the model, dtype, layout and salt."""
        return encoder_input_hash(replace(self.namespace(salt), block_size=0), array)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validates ``request``; raises InvalidRequest (or RequestOutOfRange) naming the field."""
        encoder_input = encoder_array(request.encoder, self.spec, self.tokenizer, self.encoder)
        if encoder_input is not None and not request.prompt and not request.prompt_token_ids:
            # An encoder-decoder model's decoder starts from its start token when given no prompt.
            if self.spec.decoder_start_token_id is None:
                raise InvalidRequest("prompt", f"model {self.spec.name} names no decoder start token: give a decoder prompt")
            return PreparedRequest(self._checked([self.spec.decoder_start_token_id], request), encoder_input)
        return PreparedRequest(self._checked(self._prompt_ids(request), request), encoder_input)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
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
        return ids

    def _checked(self, ids: list[int], request: GenerationRequest) -> list[int]:
        cap = self.options.max_new_tokens_cap
        if not 1 <= request.max_new_tokens <= cap:
            raise InvalidRequest("max_new_tokens", f"must be between 1 and {cap}, got {request.max_new_tokens}")
        if len(ids) + request.max_new_tokens > self.spec.context_length:
            raise RequestOutOfRange(
                "max_new_tokens",
                f"prompt ({len(ids)} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
                f"context length of {self.spec.context_length} tokens",
            )
        s = request.sampling
        if not (math.isfinite(s.temperature) and s.temperature >= 0.0):
            raise InvalidRequest("sampling.temperature", f"must be a finite number >= 0 (0 = greedy), got {s.temperature}")
        if not 0.0 < s.top_p <= 1.0:
            raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
        for i, stop in enumerate(request.stop):
            if not stop:
                raise InvalidRequest(f"stop[{i}]", "stop strings must not be empty")
        return ids

    async def _lookup(self, ids: list[int], namespace: Namespace, control: CacheControl) -> PrefixLookup:
        """The prompt's cached run of blocks (none when the request skips reading)."""
        if control.skip_read:
            return PrefixLookup(hashes=self.prefix.hashes(namespace, ids), blocks=[])
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._store_executor, self.prefix.lookup, namespace, ids)

    async def _cached_cross(self, input_hash: BlockHash, control: CacheControl) -> np.ndarray | None:
        """The encoder input's cross K/V from the store, or None (miss, or the request skips reading)."""
        if control.skip_read:
            return None
        loop = asyncio.get_running_loop()
        s = self.spec
        return await loop.run_in_executor(self._store_executor, self.cross.get, input_hash, s.num_layers,
                                          self.session.cross_heads, s.head_size, self.session.kv_dtype)

    def _publish_cross_later(self, input_hash: BlockHash, kv: np.ndarray) -> None:
        """Stores freshly computed cross K/V on the store threads, off the token path."""
        self._in_background(lambda: self.cross.put(input_hash, kv))

    @staticmethod
    def cached_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
        """Prompt tokens served from cached blocks. At least the last prompt token always runs,
        since its logits start generation: when every block of the prompt is cached, the past holds
        all but the last token (DESIGN invariant 3)."""
        return min(hit_blocks * block_size, prompt_tokens - 1)

    def _publish_later(self, hashes: list[BlockHash], first_block: int, prefill: KVCache, block_size: int) -> None:
        """Publishes blocks ``first_block ..`` of the prompt (those the store lacked) on the store
        threads, off the token path. Reading ``prefill`` while decode continues is safe: decode
        only writes positions after the prompt."""

        def publish() -> int:
            kv = self.session.to_canonical(prefill, len(hashes) * block_size)
            return self.prefix.publish(hashes, kv, first_block, block_size)

        self._in_background(publish)

    def _in_background(self, publish: Callable[[], object]) -> None:
        """Runs ``publish`` on the store threads; beyond ``max_pending_publishes`` waiting ones it is
        dropped (counted) instead, so a slow store cannot make publishes pile up in memory."""
        if len(self._pending_publishes) >= self.options.max_pending_publishes:
            self.cache_stats.add(publishes_dropped=1)
            return
        future = asyncio.get_running_loop().run_in_executor(self._store_executor, publish)
        self._pending_publishes.add(future)
        future.add_done_callback(self._pending_publishes.discard)
        self.stats.publishes += 1

    def _decode(self, request: GenerationRequest, prepared: PreparedRequest, lookup: PrefixLookup,
                cross_kv: np.ndarray | None, run_options: ort.RunOptions, halt: threading.Event,
                emit: Callable[[GenerationChunk], None], on_encoded: Callable[[np.ndarray], None],
                on_prefill: Callable[[KVCache], None], usage: Usage, timings: Timings, t0: float) -> None:
        """The token loop of one stream, on one run thread: assemble the past from the cached
        blocks, run the encoder unless its cross K/V came from the store (encoder-decoder models),
        prefill the uncached suffix, then sample, hand each token to ``emit`` and step, until a
        stop condition or until ``halt`` is set.

        Running the whole loop on one thread keeps the event loop off the token path: a step never
        waits for a thread hand-off or for the previous token to be sent, and a stream waiting for
        a free thread holds no K/V buffer yet.
        """
        if halt.is_set():
            return
        ids = prepared.ids
        capacity = len(ids) + request.max_new_tokens
        cached = usage.cached_prompt_tokens
        t_assemble = time.perf_counter()
        if cached:
            cache = self.session.cache_from_blocks(lookup.blocks, cached, capacity)
        else:
            cache = self.session.empty_cache(capacity)
        # The fetched values are copied into the past now; do not hold them for the whole decode.
        lookup.blocks = []
        timings.cache_fetch_ms += (time.perf_counter() - t_assemble) * 1e3
        sampler = Sampler(request.sampling)
        text = TextStream(self.tokenizer, request.stop)
        t_prefill = time.perf_counter()
        if prepared.encoder_input is not None:
            if cross_kv is None:
                # Stored in the decoder's K/V dtype, the dtype lookups expect.
                cross_kv = self.encoder.run(prepared.encoder_input).astype(self.session.kv_dtype, copy=False)
                on_encoded(cross_kv)
            cache.cross = self.session.cross_values(cross_kv)
        logits, cache = self.session.run(ids[cached:], cache, run_options)
        timings.prefill_ms = (time.perf_counter() - t_prefill) * 1e3
        on_prefill(cache)
        while not halt.is_set():
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
            if reason is not None:
                delta += text.finish()
                if text.stopped:  # a stop string hidden behind an unfinished character until now
                    reason = FinishReason.STOP
                timings.total_ms = (time.perf_counter() - t0) * 1e3
                emit(GenerationChunk([token], delta, reason, usage, timings))
                return
            emit(GenerationChunk([token], delta))
            logits, cache = self.session.run([token], cache, run_options)

    @staticmethod
    def _merge_ready(first: GenerationChunk | BaseException, queue: asyncio.Queue) -> GenerationChunk:
        """``first`` and whatever else the token loop has queued meanwhile, as one chunk: a client
        that reads slower than tokens are made gets fewer, larger messages."""
        items = [first]
        while not queue.empty() and not (isinstance(items[-1], GenerationChunk) and items[-1].finish_reason):
            items.append(queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise item
        last = items[-1]
        if len(items) == 1:
            return last
        return GenerationChunk([t for c in items for t in c.token_ids], "".join(c.text for c in items),
                               last.finish_reason, last.usage, last.timings)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Yields chunks until a stop condition; validation errors raise before the first chunk.

        Cancelling the consuming task stops generation at the current step: an ONNX run in flight
        is told to terminate, the token loop ends, and the stream's buffers are released.
        """
        t0 = time.perf_counter()
        prepared = self.prepare(request)
        ids = prepared.ids
        request_id = request.request_id or uuid.uuid4().hex
        self.stats.started += 1
        self.stats.active += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        halt = threading.Event()
        run_options = ort.RunOptions()
        usage = Usage(prompt_tokens=len(ids))
        timings = Timings()
        input_hash = None
        if prepared.encoder_input is not None:
            input_hash = self.encoder_input_hash(request.cache.salt, prepared.encoder_input)
        namespace = self.namespace(request.cache.salt, input_hash)
        finished = False

        def emit(item: GenerationChunk | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def token_loop(lookup: PrefixLookup, cross_kv: np.ndarray | None) -> None:
            hashes, hit_blocks = lookup.hashes, lookup.hit_blocks

            def on_encoded(kv: np.ndarray) -> None:
                if not request.cache.skip_write:
                    loop.call_soon_threadsafe(self._publish_cross_later, input_hash, kv)

            def on_prefill(prefill: KVCache) -> None:
                if not request.cache.skip_write and len(hashes) > hit_blocks:
                    loop.call_soon_threadsafe(self._publish_later, hashes, hit_blocks, prefill, namespace.block_size)

            try:
                self._decode(request, prepared, lookup, cross_kv, run_options, halt, emit, on_encoded, on_prefill,
                             usage, timings, t0)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
                emit(exc)

        try:
            t_fetch = time.perf_counter()
            if input_hash is None:
                cross_kv, lookup = None, await self._lookup(ids, namespace, request.cache)
            else:
                cross_kv, lookup = await asyncio.gather(self._cached_cross(input_hash, request.cache),
                                                        self._lookup(ids, namespace, request.cache))
            usage.encoder_cache_hit = cross_kv is not None
            usage.cached_prompt_tokens = self.cached_tokens(lookup.hit_blocks, namespace.block_size, len(ids))
            timings.cache_fetch_ms = (time.perf_counter() - t_fetch) * 1e3
            loop.run_in_executor(self._executor, token_loop, lookup, cross_kv)
            del lookup, cross_kv  # the token loop owns the fetched values now
            while not finished:
                chunk = self._merge_ready(await queue.get(), queue)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            # Reached on completion, on an error, and when the consumer is cancelled or goes away.
            halt.set()
            run_options.terminate = True
            self.stats.active -= 1
            if finished:
                self.stats.finished += 1
            else:
                self.stats.cancelled += 1
                log.info("request %s stopped after %d generated tokens (cancelled or failed)",
                         request_id, usage.completion_tokens)
