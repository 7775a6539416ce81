"""The generation engine: wires the rooms of a worker and holds nothing else.

    request ─▶ InputProcessor ─▶ Scheduler (plans) ─▶ ModelRunner (runs) ─▶ OutputProcessor ─▶ chunks
                 validate,          admission,           slots, sessions,       detokenize,
                 tokenize           step plans           sample, beams          stop strings
                                        │                      │
                                        └──── KVConnector ─────┘
                                 scheduler side: what a prompt can get from the store, another
                                 worker or another row; worker side: blocks into and out of slots

The engine knows models, tokens and a store interface; it knows nothing of gRPC. One scheduler
thread runs every model step; store lookups run on the read threads and publishes on the write
threads, so a slow publish never delays a lookup and neither ever runs on the token path.
Tokenizing runs on the tokenizer threads after size checks on the event loop; the event loop only
turns tokens into text and hands chunks to the client. ``docs/design.md`` draws the rooms.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
from jinja2 import TemplateError

from cachestore.keys import BlockHash, Namespace
from cachestore.stats import CacheStats
from cachestore.storage_dtype import resolve, storage_dtype
from cachestore.store import KVStore
from services.engine.door import Ticket, Tickets
from services.engine.engine_options import EngineOptions, derived_max_batch
from services.engine.fair_share import ClientShares
from services.engine.generation import (
    GenerationChunk,
    GenerationRequest,
    PreparedRequest,
    RequestRecord,
    TokenizeRequest,
    TokenizeResult,
)
from services.engine.input_processor import InputProcessor
from services.engine.kv_connector.connector import ConnectorOptions, KVConnector
from services.engine.kv_connector.fetch_policy import PrefixFetch
from services.engine.model_front import ModelFront
from services.engine.off_loop import OffLoop
from services.engine.output_processor import OutputProcessor, StreamEnd
from services.engine.run_waits import PrefillPace
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler
from services.errors import ModelLoadError, Overloaded
from services.runtime.chat_template import Message, load_chat_template
from services.runtime.device_arrays import ArrayDevice
from services.runtime.kv_cast import prepare as prepare_casts
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.onnx_encoder import EncoderSession
from services.runtime.slots import batches_rows
from services.runtime.split_rule import EVERY_RUN

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass(slots=True)
class EngineStats:
    """Requests since start; read by tests and logs."""

    started: int = 0
    finished: int = 0
    cancelled: int = 0
    active: int = 0


class Engine:
    def __init__(self, front: ModelFront, session: DecoderSession, options: EngineOptions, store: KVStore,
                 cache_stats: CacheStats, encoder: EncoderSession | None = None) -> None:
        spec, tokenizer = front.spec, front.tokenizer
        if options.block_size >= spec.context_length:
            # It still serves (a model with a tiny context is no error), but the user expects sharing.
            log.warning("--block-size %d is not below the model's context of %d tokens: no prompt can fill a block, "
                        "so nothing will be shared; lower --block-size", options.block_size, spec.context_length)
        self.spec = spec
        self.session = session
        self.tokenizer = tokenizer
        self.options = options
        self.stats = EngineStats()
        self.cache_stats = cache_stats
        self.store = store
        scheduling = options.scheduler
        if not scheduling.max_batch:
            budget = options.kv_cache_bytes or session.device.default_kv_cache_bytes
            per_token = spec.kv_bytes_per_token(session.kv_dtype.itemsize)
            slot = per_token * spec.context_length
            if budget < slot:
                log.warning("--kv-cache-bytes %d holds less than one slot (%d bytes: a whole context of %d tokens); "
                            "serving with 1 slot of %d bytes", budget, slot, spec.context_length, slot)
            scheduling = replace(scheduling, max_batch=derived_max_batch(per_token, spec.context_length, budget))
        self.request_observers: list[Callable[[RequestRecord], None]] = []
        """Called on the event loop once per request that ends."""
        pace = PrefillPace(options.leases.first_ms_per_token)
        shared_rows = batches_rows(session)  # the slots order layers as the store's groups
        # Bit for bit where activations are rounded to int8 (float rounding is within tolerance
        # otherwise, and such K/V may be shared between unlike CPUs).
        numerics = session.numerics if spec.quantized_activations else None
        self.connector = KVConnector(spec, session.kv_dtype, session.cross_heads,
                                     storage_dtype(resolve(options.cache_dtype, session.kv_dtype,
                                                           spec.quantized_activations)),
                                     store, cache_stats, ConnectorOptions(
                                         block_size=options.block_size, namespace_secret=options.namespace_secret,
                                         max_value_bytes=options.max_value_bytes,
                                         store_write_threads=options.store_write_threads,
                                         max_pending_publishes=options.max_pending_publishes,
                                         max_pending_publish_bytes=options.max_pending_publish_bytes,
                                         leases=options.leases, chunk_tokens=scheduling.max_prefill_tokens_per_step,
                                         prefix_fetch=options.prefix_fetch,
                                         numerics=numerics.fingerprint if numerics else "",
                                         shares=numerics is None or numerics.exact),
                                     pace, on_device=not session.on_host,
                                     layer_order=spec.layer_order if shared_rows else tuple(range(spec.num_layers)),
                                     split_windows=(options.window_fetch and shared_rows
                                                    and spec.windows.window >= options.block_size))
        shares = ClientShares(scheduling.max_client_rows)
        self.runner = ModelRunner(session, encoder, scheduling.max_batch, spec.context_length,
                                  self.connector.worker_side, pace, shares,
                                  session.numerics.rule if session.numerics else EVERY_RUN,
                                  numerics.decode_rule if numerics else EVERY_RUN, spec.quantized_activations)
        self._read_pool = ThreadPoolExecutor(max_workers=options.store_read_threads, thread_name_prefix="kv-read")
        self.scheduler = Scheduler(self.runner, self.connector.scheduler_side, scheduling, self._read_pool)
        self._off_loop = OffLoop(options.tokenizer_threads)
        self._warming: threading.Thread | None = None
        self._audio_loop = OffLoop(options.audio_threads, "audio")
        self._tokenize_loop = OffLoop(1, "tokenize-call")
        self.audio_door = Tickets(options.max_audio_requests, "requests to this encoder model (audio or features)",
                                  "--max-audio-requests")
        self.tokenize_door = Tickets(options.max_tokenize_requests, "Tokenize calls", "--max-tokenize-requests")
        self.limits = front.limits
        self.inputs = InputProcessor(spec, session, encoder, tokenizer, self.limits, options.max_new_tokens_cap,
                                     scheduling.max_batch, self._off_loop, self._audio_loop,
                                     (scheduling.max_unread_tokens, scheduling.max_unread_bytes),
                                     scheduling.stream_interval)
        self.inputs.generation_defaults = front.defaults
        self.outputs = OutputProcessor(tokenizer, self._off_loop)
        # What tests, benchmarks and metrics read: each room's own object, not a copy.
        self.slots, self.encoder = self.runner.slots, self.runner.encoder
        self.waits, self.prefix, self.cross = self.connector.waits, self.connector.prefix, self.connector.cross
        self.storage_dtype = self.connector.storage_dtype
        log.info("cache: K/V stored as %s, %d bytes per cached token (--cache-dtype %s%s; the model's own K/V is %s)",
                 self.storage_dtype.name, spec.kv_bytes_per_token(self.storage_dtype.itemsize), options.cache_dtype,
                 ": the model's matmuls quantize activations" if spec.quantized_activations and
                 self.storage_dtype.itemsize == 4 and options.cache_dtype == "auto" else "",
                 session.kv_dtype.name)
        if session.numerics is not None:
            log.info("numerics: %s", session.numerics.describe())
        if numerics is not None and not numerics.exact:
            log.warning("this model's answers would depend on what was cached, so this worker neither reads nor "
                        "publishes K/V")
        if len(spec.layer_groups) > 1:
            self._log_layer_groups()
        if options.prefix_fetch is PrefixFetch.AUTO and not session.on_host:
            log.info("prefix fetch: a cached run expected faster to compute than to fetch is computed "
                     "(--prefix-fetch auto, on a device)")
        log.info("scheduler: %d slots (%s), %d queued at most, %d prefill tokens per step, %s",
                 scheduling.max_batch, "one batched decode run per step" if self.slots.batched
                 else "each row runs batch 1: this graph has no shared GQA past/present buffer",
                 scheduling.max_queued, scheduling.max_prefill_tokens_per_step,
                 f"at most {shares.max_rows} rows per client" if shares.max_rows else "fair shares between clients")
        log.info("K/V slots on %s (%s): %d x %d tokens, %d bytes", session.device_name, session.execution_provider,
                 scheduling.max_batch, spec.context_length, self.slot_bytes)
        if session.device.budget is not None:
            log.info("device memory on %s: %s", session.device_name, session.device.budget.describe())

    def _log_layer_groups(self) -> None:
        """The memory formula per layer group, for models with sliding-window layers."""
        spec, split = self.spec, self.prefix.geometry.window > 0
        for group in spec.layer_groups:
            layers = len(group.layers)
            span = f"the last {group.window} positions" if group.window else "every earlier position"
            fetch = ""
            if group.window:
                fetch = (f"; a fetch reads it for the blocks of a continuation's last {group.window} positions only"
                         if split else "; stored and fetched with the other layers, for every cached position "
                         "(--window-fetch false, or slots that keep each row apart, or a window under one block)")
            log.info("layers %s read %s: %d bytes per token in the slots (every position is kept), %d bytes per "
                     "cached token in the store%s", ",".join(map(str, group.layers)), span,
                     spec.kv_bytes_per_token(self.session.kv_dtype.itemsize, layers),
                     spec.kv_bytes_per_token(self.storage_dtype.itemsize, layers), fetch)

    @property
    def slot_bytes(self) -> int:
        """K/V memory of the slots when every one holds a whole context (bytes, the model's dtype)."""
        spec = self.spec
        return self.scheduler.options.max_batch * spec.context_length * spec.kv_bytes_per_token(
            self.session.kv_dtype.itemsize)

    @classmethod
    def load(cls, model_dir: Path, options: EngineOptions, store: KVStore, cache_stats: CacheStats,
             device: str | ArrayDevice = "auto", intra_op_threads: int = 0, intra_op_spinning: str | None = None,
             front: ModelFront | None = None) -> Engine:
        """``device``: ``--device`` (``device_choice``; a CUDA device that cannot be used raises
        StartupError), or the arrays themselves. ``front``: the folder's ``ModelFront`` when it was
        read already (else it is read here)."""
        front = front or ModelFront.read(model_dir, options)
        spec = front.spec
        session = DecoderSession(spec, device, intra_op_threads, intra_op_spinning)
        encoder = EncoderSession(spec, session.device, intra_op_threads, intra_op_spinning) if spec.encoder else None
        engine = cls(front, session, options, store, cache_stats, encoder)
        try:
            engine.inputs.chat_template = load_chat_template(model_dir)
        except (ValueError, TemplateError) as exc:  # JSONDecodeError is a ValueError
            engine.close()
            raise ModelLoadError(f"{model_dir / 'tokenizer_config.json'}: unusable chat template ({exc})") from exc
        return engine

    def warm_up(self, prefault_tokens: int, connections: int) -> threading.Thread:
        """Readies, on a thread of its own beside serving, what a fresh worker's first warm
        request would otherwise pay for: ``connections`` store connections opened, the K/V dtype
        conversions made, and the first ``prefault_tokens`` positions of the first slot row faulted
        in (the first warm fetch of SmolLM2's 1,216 cached tokens took 0.9-1.7 s on a fresh worker
        here, later ones 56-82 ms). Nothing it does changes what a request computes or reads."""

        def run() -> None:
            started, store = time.perf_counter(), f"store checked (up to {connections} connections opened)"
            try:
                self.store.ping(connections)
            except Exception as exc:  # noqa: BLE001 - a store down at start is the breaker's business, not this one's
                store = f"the store did not answer ({type(exc).__name__}): its connections open on first use"
            prepare_casts(self.storage_dtype, self.session.kv_dtype)
            faulted = self.runner.prefault(prefault_tokens)
            log.info("warm-up: %s, %.0f MB of slot memory faulted in (--prefault-tokens %d) in %.2f s", store,
                     faulted / 1e6, prefault_tokens, time.perf_counter() - started)

        self._warming = threading.Thread(target=run, name="warm-up", daemon=True)
        self._warming.start()
        return self._warming

    def end_streams(self) -> None:
        """A draining worker's last second: every stream still running or queued ends now, one
        that sent tokens with ABORT (what was sent stays valid), so that its client gets a last
        message rather than the server's cancel."""
        self.scheduler.end_all(Overloaded("the worker is shutting down: its drain (--drain-s) ended before this "
                                          "request did; retry on another replica"))

    def close(self) -> None:
        # A warm-up still running ONNX Runtime when the interpreter finalizes aborts the process
        # (its thread is ended inside a C++ frame): a worker that stops at once, e.g. on a taken
        # port, exited -6 instead of 2 about one time in eight.
        if self._warming is not None:
            self._warming.join()
        self.waits.close()
        self.scheduler.close()
        self._read_pool.shutdown(wait=True)
        self.connector.close()
        self._off_loop.close()
        self._audio_loop.close()
        self._tokenize_loop.close()

    async def wait_for_publishes(self) -> None:
        """Returns once every publish scheduled so far has reached the store (or failed)."""
        await self.connector.drained()

    def namespace(self, salt: str, encoder_input: BlockHash | None = None, tenant: str = "") -> Namespace:
        """The namespace of this worker's prefix K/V under ``salt`` and ``tenant`` (``KVConnector.namespace``)."""
        return self.connector.namespace(salt, encoder_input, tenant)

    def encoder_input_hash(self, salt: str, array: np.ndarray, tenant: str = "") -> BlockHash:
        """The name of an encoder input's cross K/V (``KVConnector.encoder_input_hash``)."""
        return self.connector.encoder_input_hash(salt, array, tenant)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validates and tokenizes ``request`` (``InputProcessor.prepare``)."""
        return self.inputs.prepare(request)

    def render_chat(self, messages: list[Message]) -> str:
        """The prompt text of ``messages`` by the folder's chat template (``InputProcessor.render_chat``)."""
        return self.inputs.render_chat(messages)

    def door(self, client: str, generate: bool) -> Ticket | None:
        """Asked by a face before it reads a call's body: raises ``Overloaded`` when the call would
        be refused anyway (a full worker, a client over its share, every audio or Tokenize place
        taken), so that a refusal costs no body, no parsing and no tokenizing. Returns the place
        the call holds (give it to ``generate`` or ``tokenize``; release it if the call ends
        before), or None. ``generate``: a Generate call, else a Tokenize call."""
        if not generate:
            return self.tokenize_door.take(client)
        self.scheduler.check_room(client)
        # Any request to a model with an encoder may carry audio or encoder features up to the message
        # limit: each such call holds a place while its message arrives, whatever it turns out to carry.
        return self.audio_door.take(client) if self.spec.encoder is not None else None

    async def tokenize(self, request: TokenizeRequest, shape: Callable[[TokenizeResult], R],
                       ticket: Ticket | None = None, client: str = "") -> R:
        """The Tokenize call (``InputProcessor.tokenize``) on the Tokenize thread, under ``ticket``
        (the door's place; without one, a place is taken here for ``client``)."""
        with ticket or self.tokenize_door.take(client):
            return await self.inputs.tokenize(request, shape, self._tokenize_loop, client)

    async def generate(self, request: GenerationRequest, ticket: Ticket | None = None) -> AsyncIterator[GenerationChunk]:
        """Yields chunks until every sample has ended; validation errors and ``Overloaded`` raise
        before the first chunk. Closing the stream (cancel, deadline, client gone) frees every
        slot of the request at the scheduler's next step. ``ticket``: the place ``door`` gave the
        call, held until the request is prepared (a request with audio and none takes one here)."""
        t0 = time.perf_counter()
        if ticket is None and request.encoder.audio:
            ticket = self.audio_door.take(request.client)
        try:
            # A full worker, or a client over its share, is refused before the work of preparing
            # (tokenizing; audio: up to a second of decoding): the rows are held from here on.
            reservation = self.scheduler.reserve(request.client, request.rows)
            try:
                prepared = await self.inputs.prepare_async(request)
                rows = self.inputs.rows(request, prepared, t0, lambda cache, count: self.connector.states(
                    cache, request.tenant, prepared.encoder_input, count))
                self.scheduler.submit(rows, reservation)
            except BaseException:
                self.scheduler.cancel(reservation)
                raise
        finally:
            if ticket is not None:
                ticket.release()
        if request.encoder.audio:
            # Prepared: its features are in ``prepared``; the WAV's bytes (up to --max-message-bytes)
            # must not stay in memory for as long as the request queues and streams.
            request = replace(request, encoder=replace(request.encoder, audio=None))
        self.stats.started += 1
        self.stats.active += 1
        ended = StreamEnd()
        try:
            async with aclosing(self.outputs.stream(request, rows, prepared.stops, self.scheduler, ended)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            # Reached on completion, on an error, and when the consumer is cancelled or goes away.
            self.scheduler.abort(rows)
            self.connector.scheduler_side.request_finished(rows)
            self.stats.active -= 1
            if ended.complete:
                self.stats.finished += 1
            else:
                self.stats.cancelled += 1
            record = self.outputs.record(rows[0], ended.finish if ended.complete else None)
            for observe in self.request_observers:
                observe(record)
