"""The generation engine: validates a request, admits it to the scheduler, reuses its cached prefix,
and streams the tokens the scheduler produces as text.

The engine knows models, tokens and a store interface; it knows nothing of gRPC. The scheduler
(one thread) runs every model step for all sequences of the worker; store lookups run on the read
threads and publishes on the write threads, so a slow publish never delays a lookup and neither
ever runs on the token path. Rendering chat templates, tokenizing and building stop automata run
on the tokenizer threads, after size checks on the event loop (``RequestLimits``): the Rust
tokenizer releases the GIL, so a megabyte-sized prompt neither blocks the loop nor the scheduler.
The event loop only turns tokens into text and hands chunks to the client.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
from jinja2 import TemplateError

from cachestore.codec import RejectReason
from cachestore.cross import CrossStore
from cachestore.keys import (
    BlockHash,
    Namespace,
    block_hashes,
    block_key,
    cross_key,
    encoder_input_hash,
    lease_key,
    progress_channel,
)
from cachestore.prefix import CANONICAL_LAYOUT, KVGeometry, PrefixLookup, PrefixStore
from cachestore.ratelimit import RateLimitedLog
from cachestore.stats import CacheStats
from cachestore.storage_dtype import DEFAULT as DEFAULT_CACHE_DTYPE
from cachestore.storage_dtype import storage_dtype
from cachestore.store import KVStore
from services.engine.beam_search import BeamState
from services.engine.encoder_input import encoder_array
from services.engine.generation import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    PreparedRequest,
    TokenizeRequest,
    TokenizeResult,
    Usage,
)
from services.engine.leases import Claim, HeldLeases, Tokens
from services.engine.logprobs import MAX_TOP_LOGPROBS, with_text
from services.engine.penalties import LogitsAdjuster
from services.engine.request_limits import (
    SHRINKING_TOKENIZER_FACTOR,
    RequestLimits,
    derived_prompt_bytes,
)
from services.engine.run_waits import (
    MIN_STALL_MS,
    LeaseOptions,
    PrefillPace,
    RunWait,
    RunWaits,
    WaitEnd,
)
from services.engine.sampling import Sampler
from services.engine.scheduler import Scheduler, SchedulerOptions
from services.engine.sequence import Ahead, Sequence, SequenceGroup, Trail
from services.engine.stop_matcher import StopMatcher
from services.engine.text_stream import TextStream
from services.errors import (
    FailedPrecondition,
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    RequestOutOfRange,
)
from services.runtime.chat_template import (
    BrokenChatTemplate,
    ChatTemplate,
    ChatTemplateError,
    Message,
    load_chat_template,
)
from services.runtime.kv_cast import converted
from services.runtime.model_spec import ModelSpec, load_model_spec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.onnx_encoder import EncoderSession
from services.runtime.slots import open_slots
from services.runtime.tokenizer import TextTokenizer, TooManyTokens

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
# One line per 10 s however many poisoned prompts arrive; each is counted as bad_output.
_distrusted = RateLimitedLog(log)


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
    cache_dtype: str = DEFAULT_CACHE_DTYPE
    """Element type of K/V in the store (``cachestore.storage_dtype``): float32, float16 or bfloat16."""
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    """Batch, queue, prefill budget and back-pressure; ``max_batch`` 0 is derived from ``kv_cache_bytes``."""
    kv_cache_bytes: int = 2 << 30
    """K/V memory budget of the slots when ``scheduler.max_batch`` is 0 (bytes)."""
    store_read_threads: int = 4
    """Concurrent store lookups; never shared with publishes."""
    store_write_threads: int = 2
    """Concurrent publishes."""
    max_pending_publishes: int = 16
    """Publishes waiting for the store beyond this are dropped (counted), bounding memory."""
    max_pending_publish_bytes: int = 512 * 1024 * 1024
    """K/V bytes the waiting publishes may hold; beyond, a publish is dropped (counted) uncopied."""
    max_value_bytes: int = 128 * 1024 * 1024
    """Cross-attention values larger than this are not stored (Redis caps a value at 512 MiB)."""
    namespace_secret: bytes = field(default=b"", repr=False)
    """Keys every block and cross-attention key (``Namespace.secret``); the same on every worker."""
    max_prompt_bytes: int = 0
    """UTF-8 bytes of a prompt's text (prompt, messages, encoder prompt, Tokenize text); 0 derives
    the most that can fit the context (``request_limits.derived_prompt_bytes``)."""
    max_stop_strings: int = 64
    """Stop strings per request."""
    max_stop_string_bytes: int = 256
    """UTF-8 bytes of one stop string."""
    tokenizer_threads: int = 2
    """Threads that render chat templates, tokenize and build stop automata, off the event loop."""
    leases: LeaseOptions = field(default_factory=LeaseOptions)
    """Fleet-wide single-flight: leases on computing uncached blocks, and how long to wait for them."""


MAX_DERIVED_BATCH = 64
LEASE_SLACK_MS = 500
"""A lease lives twice the holder's expected time to compute its run, plus this (ms)."""
EARLY_WAIT_ENDS = frozenset({WaitEnd.STALLED, WaitEnd.SLOWER, WaitEnd.RELEASED})
"""Lease waits that end with blocks of the run missing, which this worker then computes itself."""
MAX_STOP_TOKEN_IDS = 64
PROMPT_LOGPROBS_PER_CHUNK = 64
"""Prompt log-probabilities per chunk: with 20 alternatives each, about 20 KB a message."""


def _after(publish: Future | None) -> None:
    """Blocks until ``publish`` (an earlier write of the same sequence) is done."""
    if publish is not None:
        wait_futures([publish])


def derived_max_batch(kv_bytes_per_token: int, context_length: int, kv_cache_bytes: int) -> int:
    """Slots that fit ``kv_cache_bytes`` when each may hold a whole context (at least 1, at most
    ``MAX_DERIVED_BATCH``): a sequence admitted can always run to its end."""
    return max(1, min(MAX_DERIVED_BATCH, kv_cache_bytes // (kv_bytes_per_token * context_length)))


class Engine:
    def __init__(self, spec: ModelSpec, session: DecoderSession, tokenizer: TextTokenizer,
                 options: EngineOptions, store: KVStore, cache_stats: CacheStats,
                 encoder: EncoderSession | None = None) -> None:
        if options.block_size >= spec.context_length:
            # It still serves (a model with a tiny context is no error), but the user expects sharing.
            log.warning("--block-size %d is not below the model's context of %d tokens: no prompt can fill a block, "
                        "so nothing will be shared; lower --block-size", options.block_size, spec.context_length)
        self.spec = spec
        self.session = session
        self.encoder = encoder
        self.storage_dtype = storage_dtype(options.cache_dtype)
        """The K/V element type in the store; part of every namespace."""
        self.cross = CrossStore(store, cache_stats, options.max_value_bytes, self.storage_dtype)
        self.tokenizer = tokenizer
        self.chat_template: ChatTemplate | None = None
        """The folder's chat template (set by ``load``), for requests given as messages."""
        self.options = options
        self.stats = EngineStats()
        self.cache_stats = cache_stats
        self.store = store
        self.prefix = PrefixStore(
            store, KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_size, self.storage_dtype), cache_stats
        )
        self._read_pool = ThreadPoolExecutor(max_workers=options.store_read_threads, thread_name_prefix="kv-read")
        self._write_pool = ThreadPoolExecutor(max_workers=options.store_write_threads, thread_name_prefix="kv-write")
        self._text_pool = ThreadPoolExecutor(max_workers=options.tokenizer_threads, thread_name_prefix="tokenize")
        self.limits = self._limits(options)
        self._publish_lock = threading.Lock()
        self._pending_publishes: set[Future] = set()
        self._pending_bytes = 0
        """Bytes the waiting publishes hold (K/V copies, cross K/V)."""
        scheduling = options.scheduler
        if not scheduling.max_batch:
            scheduling = replace(scheduling, max_batch=derived_max_batch(
                spec.kv_bytes_per_token(session.kv_dtype.itemsize), spec.context_length, options.kv_cache_bytes))
        self.request_observers: list[Callable[[Sequence, str, float], None]] = []
        """Called on the event loop once per request that ends: (sequence, outcome, seconds taken)."""
        self.slots = open_slots(session, scheduling.max_batch, spec.context_length)
        self.tokens = Tokens(uuid.uuid4().hex.encode())
        """Lease tokens: this worker, and which of its rows holds a lease."""
        self.waits = RunWaits(options.leases.poll_ms, self.store.notices if options.leases.enabled else None)
        self._awaiting: dict[str, tuple[Sequence, int]] = {}
        """Leases of other workers that a row of this one waits on, with that row and how many
        blocks it awaits (under ``_publish_lock``)."""
        self.scheduler = Scheduler(self.slots, scheduling, self, self._read_pool,
                                   PrefillPace(options.leases.first_ms_per_token))
        log.info("cache: K/V stored as %s, %d bytes per cached token (--cache-dtype; the model's own K/V is %s)",
                 self.storage_dtype.name, spec.kv_bytes_per_token(self.storage_dtype.itemsize), session.kv_dtype.name)
        log.info("scheduler: %d slots (%s), %d queued at most, %d prefill tokens per step", scheduling.max_batch,
                 "one batched decode run per step" if self.slots.batched
                 else "each row runs batch 1: no shared GQA past/present buffer in host memory for this graph",
                 scheduling.max_queued, scheduling.max_prefill_tokens_per_step)

    def _limits(self, options: EngineOptions) -> RequestLimits:
        if options.max_prompt_bytes:
            prompt_bytes, origin = options.max_prompt_bytes, "set by the operator"
        else:
            token_bytes = self.tokenizer.token_bytes()
            context = max(self.spec.context_length, (self.spec.encoder and self.spec.encoder.context_length) or 0)
            prompt_bytes = derived_prompt_bytes(context, token_bytes)
            origin = (f"the most text that can fit the model's context of {context} tokens, at most "
                      f"{token_bytes.longest} bytes per token")
            if token_bytes.shrinker is not None:
                origin = (f"{SHRINKING_TOKENIZER_FACTOR}x the context of {context} tokens at {token_bytes.longest} "
                          f"bytes per token, since the tokenizer's {token_bytes.shrinker} can drop text")
                log.warning("the tokenizer's %s can drop or shorten text, so no prompt size is too large to fit the "
                            "context; prompts are limited to %d bytes (--max-prompt-bytes sets another limit)",
                            token_bytes.shrinker, prompt_bytes)
        log.info("requests: prompts up to %d bytes (%s), %d stop strings of up to %d bytes", prompt_bytes, origin,
                 options.max_stop_strings, options.max_stop_string_bytes)
        return RequestLimits(prompt_bytes, origin, options.max_stop_strings, options.max_stop_string_bytes)

    @classmethod
    def load(cls, model_dir: Path, options: EngineOptions, store: KVStore, cache_stats: CacheStats,
             execution_provider: str = "auto", intra_op_threads: int = 0, intra_op_spinning: bool = False) -> Engine:
        spec = load_model_spec(model_dir)
        session = DecoderSession(spec, execution_provider, intra_op_threads, intra_op_spinning)
        encoder = EncoderSession(spec, execution_provider, intra_op_threads, intra_op_spinning) if spec.encoder else None
        engine = cls(spec, session, TextTokenizer(model_dir / "tokenizer.json"), options, store, cache_stats, encoder)
        try:
            engine.chat_template = load_chat_template(model_dir)
        except (ValueError, TemplateError) as exc:  # JSONDecodeError is a ValueError
            engine.close()
            raise ModelLoadError(f"{model_dir / 'tokenizer_config.json'}: unusable chat template ({exc})") from exc
        return engine

    def close(self) -> None:
        self.waits.close()
        self.scheduler.close()
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        self._text_pool.shutdown(wait=True)
        self.store.close()

    async def wait_for_publishes(self) -> None:
        """Returns once every publish scheduled so far has reached the store (or failed)."""
        with self._publish_lock:
            pending = list(self._pending_publishes)
        if pending:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending), return_exceptions=True)

    def namespace(self, salt: str, encoder_input: BlockHash | None = None, tenant: str = "") -> Namespace:
        """Everything this worker's prefix K/V depends on besides the tokens (docs/design.md, invariant 2):
        for an encoder-decoder model also the encoder input, whose cross-attention feeds every
        decoder layer, so the same decoder prompt under another encoder input never hits. Keyed by
        the fleet's namespace secret when one is configured."""
        return Namespace(
            model_fingerprint=self.spec.fingerprint,
            block_size=self.options.block_size,
            dtype=self.storage_dtype.name,
            layout=CANONICAL_LAYOUT,
            salt=salt,
            tenant=tenant,
            extra=encoder_input.hex() if encoder_input else "",
            secret=self.options.namespace_secret,
        )

    def encoder_input_hash(self, salt: str, array: np.ndarray, tenant: str = "") -> BlockHash:
        """Names an encoder input (and so its cross K/V) under the model, dtype, layout, tenant and salt."""
        return encoder_input_hash(replace(self.namespace(salt, tenant=tenant), block_size=0), array)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validates and tokenizes ``request``; raises InvalidRequest (or RequestOutOfRange) naming
        the field. ``generate`` runs the same two parts apart: the size checks on the event loop,
        ``tokenized`` on a tokenizer thread."""
        self.limits.check_generation(request)
        return self.tokenized(request)

    def tokenized(self, request: GenerationRequest) -> PreparedRequest:
        """Everything of ``prepare`` after the size checks: the cheap checks first, then the work
        (rendering, tokenizing, the encoder input, the stop automaton)."""
        self._check_generation_fields(request)
        encoder_input = encoder_array(request.encoder, self.spec, self.tokenizer, self.encoder)
        if encoder_input is not None and not request.prompt and not request.prompt_token_ids:
            # An encoder-decoder model's decoder starts from its start token when given no prompt.
            if self.spec.decoder_start_token_id is None:
                raise InvalidRequest("prompt", f"model {self.spec.name} names no decoder start token: give a decoder prompt")
            ids = [self.spec.decoder_start_token_id]
        else:
            ids = self._prompt_ids(request)
        if len(ids) + request.max_new_tokens > self.spec.context_length:
            raise self._beyond_context(len(ids), request.max_new_tokens)
        return PreparedRequest(ids, encoder_input, StopMatcher(request.stop) if request.stop else None)

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

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if sum(map(bool, (request.prompt, request.prompt_token_ids, request.messages))) > 1:
            raise InvalidRequest("prompt", "set one of prompt, prompt_token_ids and messages")
        # More tokens than this cannot run; they are counted, never turned into Python ints.
        room = self.spec.context_length - request.max_new_tokens
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
            raise self._beyond_context(exc.count, request.max_new_tokens) from None
        if not ids:
            raise InvalidRequest("prompt", "the prompt encodes to no tokens")
        return ids

    def _checked_ids(self, field: str, ids: Iterable[int]) -> list[int]:
        ids = list(ids)
        for i, t in enumerate(ids):
            if not 0 <= t < self.spec.vocab_size:
                raise InvalidRequest(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {self.spec.vocab_size})")
        return ids

    def _beyond_context(self, prompt_tokens: int, max_new_tokens: int) -> RequestOutOfRange:
        return RequestOutOfRange(
            "max_new_tokens",
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"context length of {self.spec.context_length} tokens",
        )

    def _check_generation_fields(self, request: GenerationRequest) -> None:
        cap = self.options.max_new_tokens_cap
        if not 1 <= request.max_new_tokens <= cap:
            raise InvalidRequest("max_new_tokens", f"must be between 1 and {cap} (the worker's --max-new-tokens-cap), "
                                 f"got {request.max_new_tokens}")
        if request.min_new_tokens > request.max_new_tokens:
            raise InvalidRequest("min_new_tokens", f"must not exceed max_new_tokens ({request.max_new_tokens}), "
                                 f"got {request.min_new_tokens}")
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
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
        if request.top_logprobs and not (request.logprobs or request.prompt_logprobs):
            raise InvalidRequest("top_logprobs", "applies to logprobs or prompt_logprobs: set one of them")
        if request.prompt_logprobs and not self.session.logits_per_position:
            raise FailedPrecondition(f"model {self.spec.name}'s graph emits only the last position's logits: "
                                     "prompt_logprobs cannot be computed")
        self._check_rows(request)

    def _check_rows(self, request: GenerationRequest) -> None:
        """n samples and beam search: each row is a slot, so a request may hold at most the batch."""
        rows_cap = self.scheduler.options.max_batch
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

    async def tokenize(self, request: TokenizeRequest, shape: Callable[[TokenizeResult], R]) -> R:
        """The Tokenize call: text or messages to ids, or ids to text; returns ``shape(result)``.
        Sizes are checked on the event loop; the rest, ``shape`` included, runs on a tokenizer
        thread: turning a million ids into the caller's message must not hold the loop."""
        self.limits.check_prompt("text", request.text, request.messages)
        return await self._off_loop(lambda r: shape(self._tokenize(r)), request)

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

    async def _off_loop(self, work: Callable[[T], R], arg: T) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, work, arg)

    @staticmethod
    def cached_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
        """Prompt tokens served from cached blocks. At least the last prompt token always runs,
        since its logits start generation: when every block of the prompt is cached, the past holds
        all but the last token (docs/design.md, invariant 3)."""
        return min(hit_blocks * block_size, prompt_tokens - 1)

    # The scheduler's hooks (services.engine.scheduler.Hooks).

    def fetch(self, seq: Sequence, done: Callable[[], None]) -> bool:
        """On a read thread: the prompt's cached run of blocks, copied into the sequence's slot as
        they arrive where the slots allow it, and, for encoder-decoder models, the encoder input's
        cross K/V (none when the request skips reading). When another worker holds the lease on
        the prompt's first missing blocks, returns False and waits for them on the waits' thread
        (``services.engine.run_waits``), calling ``done`` at the end; else returns True."""
        t = time.perf_counter()
        receiver = self.slots.receiver(seq.slot)
        if seq.cache.skip_read:
            seq.lookup = PrefixLookup(hashes=self.prefix.hashes(seq.namespace, seq.prompt), blocks=[])
        else:
            seq.lookup = self.prefix.lookup(seq.namespace, seq.prompt, receiver)
            if seq.encoder_hash is not None:
                s = self.spec
                seq.cross_kv = self.cross.get(seq.encoder_hash, s.num_layers, self.session.cross_heads, s.head_size)
        claim, holder, key = self._claim(seq, receiver)
        # A row of this worker that has already published part of the prompt may finish, freeing
        # the slot this row would copy from, before this row's first step: then its blocks are
        # waited for in the store, as another worker's are, not computed again.
        if not (claim is Claim.OTHER_WORKER or (claim is Claim.SIBLING and seq.lookup.hit_blocks > 0)):
            self._fetched(seq, t)
            return True
        run = len(seq.lookup.hashes) - seq.lookup.hit_blocks  # blocks awaited
        with self._publish_lock:
            # One store wait per lease and worker when it covers this row's: the worker's other
            # rows wait for that row's blocks and copy them from it (``Scheduler._plan_share``).
            # A row missing fewer blocks waits for its own, not for the other row's longer run.
            if key in self._awaiting and run >= self._awaiting[key][1]:
                self._fetched(seq, t)
                return True
            own = key not in self._awaiting
            if own:
                self._awaiting[key] = (seq, run)
                seq.awaiting = True
        factor, size = self.options.leases.wait_factor, seq.namespace.block_size
        pace = self.scheduler.pace
        chunk = self.scheduler.options.max_prefill_tokens_per_step
        stall_ms = max(MIN_STALL_MS, factor * pace.expected_ms(min(3 * chunk, run * size)))

        def end(outcome: WaitEnd) -> None:
            self.cache_stats.count("lease_waits", outcome.value)
            if outcome in (WaitEnd.STALLED, WaitEnd.SLOWER):  # the holder may still publish ahead of this row
                seq.trail = Trail(key, holder)
            # A wait given up on (the holder stalled, looked slower than computing, or let go early)
            # means computing what another worker computes too: worth a line at the default level.
            # Complete and cancelled waits are not, and a failed poll has logged its exception.
            level = logging.INFO if outcome in EARLY_WAIT_ENDS else logging.DEBUG
            log.log(level, "request %s: waited %.0f ms for another worker's %d blocks: %s, %d arrived%s",
                    seq.request_id, (time.perf_counter() - t) * 1e3, run, outcome.value, seq.lookup.hit_blocks,
                    f" ({wait.detail})" if wait.detail else "")
            self._fetched(seq, t)
            if own:
                with self._publish_lock:
                    del self._awaiting[key]
            done()

        self.cache_stats.add(blocks_awaited=run)
        wait = RunWait(
            fetch_more=lambda: self._fetch_more(seq.lookup, size, receiver),
            missing=lambda: len(seq.lookup.hashes) - seq.lookup.hit_blocks,
            held=lambda: self.store.holder(key) == holder,
            cancelled=lambda: seq.aborted or seq.done,
            compute_s=lambda blocks: factor * pace.expected_ms(blocks * size) / 1e3,
            stall_s=stall_ms / 1e3,
            first_stall_s=max(stall_ms, factor * pace.expected_ms(run * size)) / 1e3,
            pace_blocks=-(-2 * chunk // size),
            on_end=end,
            channel=progress_channel(holder),
        )
        self.waits.add(wait)
        return False

    def look_ahead(self, seq: Sequence) -> Future:
        """For a row on a ``Trail``, between two chunks: waits on the waits' thread for the blocks
        from the row's next one on, until the next chunk's blocks are all there, the holder lets go
        of its lease, or nothing came for as long as computing that chunk would take the row now
        (wait factor included, at what its latest chunk cost; at least two polls). The future
        holds an ``Ahead`` (kept up: the whole chunk came, and no later than computing what came
        would have taken), or None when nothing came."""
        result: Future = Future()
        size, start = seq.namespace.block_size, seq.prefilled
        hashes = seq.lookup.hashes
        if seq.cache.skip_read or start % size or start // size >= len(hashes):
            result.set_result(None)
            return result
        found = PrefixLookup(hashes=hashes, blocks=[], hit_blocks=start // size)
        trail, leases = seq.trail, self.options.leases
        ms_per_token = trail.ms_per_token or self.scheduler.pace.ms_per_token
        chunk_blocks = -(-self.scheduler.options.max_prefill_tokens_per_step // size)
        wanted = min(found.hit_blocks + chunk_blocks, len(hashes))
        bound_s = max(2 * leases.poll_ms, leases.wait_factor * ms_per_token * chunk_blocks * size) / 1e3
        began = time.monotonic()
        trail.give_up_at = began + 2 * bound_s

        def end(outcome: WaitEnd) -> None:
            tokens = self.cached_tokens(found.hit_blocks, size, len(seq.prompt))
            if tokens <= start:
                result.set_result(None)
                return
            in_time = time.monotonic() - began <= leases.wait_factor * ms_per_token * (tokens - start) / 1e3
            result.set_result(Ahead(start, found.blocks, tokens, outcome is WaitEnd.COMPLETE and in_time))

        self.waits.add(RunWait(
            fetch_more=lambda: self._fetch_more(found, size, None),
            missing=lambda: max(0, wanted - found.hit_blocks),
            held=lambda: self.store.holder(trail.key) == trail.holder,
            cancelled=lambda: seq.aborted or seq.done,
            compute_s=lambda blocks: leases.wait_factor * ms_per_token * blocks * size / 1e3,
            stall_s=bound_s,
            first_stall_s=bound_s,
            pace_blocks=chunk_blocks,
            on_end=end,
            channel=progress_channel(trail.holder),
        ))
        return result

    def _fetch_more(self, found: PrefixLookup, block_size: int, receiver: Callable[[int, np.ndarray], bool] | None
                    ) -> int:
        """One poll of a wait: the next missing block alone (most polls find nothing: one GET, not
        one per missing block), then, once it came, every block that follows it."""
        arrived = self.prefix.extend(found, block_size, receiver, limit=1)
        if arrived:
            arrived += self.prefix.extend(found, block_size, receiver)
        self.cache_stats.add(blocks_received=arrived)
        return arrived

    def _claim(self, seq: Sequence, receiver: Callable[[int, np.ndarray], bool] | None
               ) -> tuple[Claim, bytes | None, str | None]:
        """The fleet's single-flight (``services.engine.leases``): when the prompt has uncached
        full blocks, takes the lease on computing them (then ``seq.lease`` holds it), or finds
        who holds it. Returns what the claim found, the holder's token and the lease's key.

        A lease found free may have been released just now by a holder that finished the prompt
        after this sequence's lookup read the store: that holder stored every block before its
        release, so the lookup reads on once before this sequence computes them again."""
        hashes, size = seq.lookup.hashes, seq.namespace.block_size
        if not self.options.leases.enabled or seq.cache.skip_read or seq.cache.skip_write:
            return Claim.NONE, None, None
        while seq.lookup.hit_blocks < len(hashes):
            hit = seq.lookup.hit_blocks
            key, token = lease_key(hashes[hit]), self.tokens.new()
            ttl_ms = int(2 * self.scheduler.pace.expected_ms((len(hashes) - hit) * size) + LEASE_SLACK_MS)
            holder = self.store.claim(key, token, ttl_ms)
            claim = self.tokens.classify(holder, token)
            if claim is Claim.HELD and self.prefix.extend(seq.lookup, size, receiver):
                self.store.release(key, token)
                continue
            if claim is Claim.HELD:
                seq.lease = HeldLeases(self.store, token, ttl_ms, [key])
                if seq.aborted or seq.done:  # the request ended while the claim was on its way
                    self.release_leases([seq])
            return claim, holder, key
        return Claim.NONE, None, None

    def _fetched(self, seq: Sequence, t0: float) -> None:
        """The lookup's end: what it found becomes the sequence's cached prompt."""
        seq.usage.encoder_cache_hit = seq.cross_kv is not None
        seq.prefilled = seq.usage.cached_prompt_tokens = self.cached_tokens(
            seq.lookup.hit_blocks, seq.namespace.block_size, len(seq.prompt))
        seq.published_blocks = seq.lookup.hit_blocks
        seq.timings.cache_fetch_ms = (time.perf_counter() - t0) * 1e3

    def release_leases(self, rows: list[Sequence]) -> None:
        """Ends the leases ``rows`` still hold (a prompt cancelled, failed or distrusted before its
        end), after their publishes in flight, off the token path, so that workers waiting on them
        compute at once."""
        for seq in rows:
            lease, seq.lease = seq.lease, None
            if lease is not None:
                earlier = seq.publishing
                # Never dropped, however many writes wait: a lease left behind holds waiters back.
                self._tracked(0, lambda lease=lease, earlier=earlier: (_after(earlier), lease.end()))

    def begin(self, seq: Sequence) -> None:
        """On the scheduler thread: copies the cached blocks the fetch kept (all, or block 0: see
        ``SlotBank.receiver``) into the sequence's slot and, for encoder-decoder models, its cross
        K/V (running the encoder on a miss)."""
        t = time.perf_counter()
        cross = seq.cross_kv
        if seq.encoder_input is not None and cross is None:
            cross = self.encoder.run(seq.encoder_input).astype(self.session.kv_dtype, copy=False)
            if not seq.cache.skip_write:
                input_hash = seq.encoder_hash

                def store_cross() -> None:
                    self.cross.put(input_hash, converted(cross, self.storage_dtype))

                self._in_background(cross.nbytes, lambda: store_cross)
        self.slots.begin(seq.slot, seq.lookup.blocks, seq.prefilled, cross)
        # The fetched values are in the slot now; do not hold them for the whole decode.
        seq.lookup.release()
        seq.cross_kv = None
        seq.timings.cache_fetch_ms += (time.perf_counter() - t) * 1e3

    def finished(self, seq: Sequence) -> None:
        """On the scheduler thread, when a sequence ended by EOS, a stop token or string, or its length: the
        full blocks of prompt + answer that the prompt's own publish did not cover are copied out
        and published, so a chat's next turn (which sends this answer back) finds them on any
        replica. The last token's K/V was never computed (it was not fed), so the blocks stop
        before it. Beams are not published: their rows were reordered along the search."""
        if seq.cache.skip_write or (seq.group is not None and seq.group.beams is not None):
            return
        size = seq.namespace.block_size
        first, last = len(seq.prompt) // size, seq.slot.length // size
        if last <= first:
            return
        tokens, namespace = [*seq.prompt, *seq.tokens][: last * size], seq.namespace
        # Hashing the whole chain is the write thread's work; only the copy must happen now.
        self._publish_blocks(seq, first, last, lambda kv: self.prefix.publish(block_hashes(namespace, tokens), kv,
                                                                            first, size))

    def prefilled(self, seq: Sequence) -> None:
        """On the scheduler thread, after each prompt chunk: copies the full blocks completed since
        the last publish (and not in the store) out of the slot and publishes them on a write
        thread, so that workers waiting for this prompt's blocks fetch each chunk as soon as it is
        computed. After the last chunk the sequence's lease ends, once its blocks are stored. The
        copy is taken now because the slot is handed to another sequence as soon as this one ends:
        publishing from the live buffer could put another request's K/V under this prompt's keys."""
        hashes, first, size = seq.lookup.hashes, seq.published_blocks, seq.namespace.block_size
        last = min(len(hashes), seq.prefilled // size)
        lease, earlier = seq.lease, seq.publishing
        prompt_done = seq.prefilled == len(seq.prompt)
        if seq.cache.skip_write or last <= first:
            if prompt_done:
                self.release_leases([seq])
            return
        if prompt_done:
            seq.lease = None

        def publish(kv: np.ndarray) -> None:
            # Chunks reach the store in order, each after the lease on the block that follows it,
            # and the leases end after the last chunk: a worker arriving mid-prompt finds its first
            # missing block leased, and a waiter never finds a gap or the lease gone too early.
            _after(earlier)
            if lease is not None and last < len(hashes):
                lease.extend(lease_key(hashes[last]))
            self.prefix.publish(hashes[:last], kv, first, size)
            if lease is not None and prompt_done:
                lease.end()
            elif lease is not None:  # waiters elsewhere look now (``run_waits``)
                lease.announce()

        seq.published_blocks = last
        published = self._publish_blocks(seq, first, last, publish)
        if published is not None:
            seq.publishing = published
        elif prompt_done and lease is not None:  # dropped: the leases end after the earlier chunks
            seq.lease = lease
            self.release_leases([seq])

    def _publish_blocks(self, seq: Sequence, first: int, last: int,
                        publish: Callable[[np.ndarray], object]) -> Future | None:
        """Copies blocks ``first .. last`` of the sequence's slot now and hands them, narrowed to
        the storage dtype on a write thread, to ``publish``, unless the pending publishes have no
        room for them: then nothing is copied (see ``_in_background``) and None is returned."""
        size = seq.namespace.block_size
        nbytes = (last - first) * size * self.spec.kv_bytes_per_token(self.session.kv_dtype.itemsize)

        def prepare() -> Callable[[], object]:
            kv = self.slots.canonical(seq.slot, first * size, last * size)
            return lambda: publish(converted(kv, self.storage_dtype))

        return self._in_background(nbytes, prepare)

    def distrust(self, seq: Sequence) -> bool:
        """On the scheduler thread, when the first token's logits are NaN or infinite. Values that
        pass the codec's checks can still be forged; if any of this request's K/V came from the
        store or from another row, the values it read and the blocks it published over them are
        deleted (off the token path, after its publishes in flight), counted as ``bad_output``,
        and the request computes its whole prompt, reading and publishing nothing: the next
        request publishes afresh."""
        cached, cross = seq.usage.cached_prompt_tokens, seq.usage.encoder_cache_hit
        if not cached and not cross:
            return False
        keys = [block_key(h) for h in seq.lookup.hashes[: max(seq.lookup.hit_blocks, seq.published_blocks)]]
        if cross:
            keys.append(cross_key(seq.encoder_hash))
        self.cache_stats.count("rejected_values", RejectReason.BAD_OUTPUT)
        _distrusted.warning("request %s: NaN or infinite logits over %d cached prompt tokens; deleting %d values and "
                            "computing the prompt again", seq.request_id, cached, len(keys))
        earlier = seq.publishing
        self._in_background(0, lambda: lambda: (_after(earlier), self.store.delete(keys)))
        self.release_leases([seq])
        seq.lookup = PrefixLookup(hashes=seq.lookup.hashes, blocks=[])
        seq.trail = None
        seq.prefilled = seq.usage.cached_prompt_tokens = seq.published_blocks = 0
        seq.usage.encoder_cache_hit = False
        seq.cross_kv = None
        seq.cache = replace(seq.cache, skip_read=True, skip_write=True)
        return True

    def _in_background(self, nbytes: int, prepare: Callable[[], Callable[[], object]]) -> Future | None:
        """Runs a publish holding ``nbytes`` on the write threads if there is room for it: fewer
        than ``max_pending_publishes`` wait, and their bytes stay within ``max_pending_publish_bytes``
        (one publish larger than that still goes when none waits, or a long prompt would never be
        shared). ``prepare`` (the copy out of a slot) runs here and returns the publish; without
        room the publish is dropped, counted, before anything is copied: a slow store, or answers
        of thousands of tokens finishing together, cannot make copies pile up in memory. Called on
        the scheduler thread only, so no other publish joins between the check and the submit.
        Returns the publish's future, or None when it was dropped."""
        with self._publish_lock:
            full = len(self._pending_publishes) >= self.options.max_pending_publishes or (
                self._pending_bytes > 0 and self._pending_bytes + nbytes > self.options.max_pending_publish_bytes)
            if full:
                self.cache_stats.add(publishes_dropped=1)
                return None
        self.stats.publishes += 1
        return self._tracked(nbytes, prepare())

    def _tracked(self, nbytes: int, job: Callable[[], object]) -> Future:
        """Runs ``job`` on the write threads, counted among the pending writes (``wait_for_publishes``)."""
        with self._publish_lock:
            self._pending_bytes += nbytes
            future = self._write_pool.submit(job)
            self._pending_publishes.add(future)
        future.add_done_callback(lambda done: self._published(done, nbytes))
        return future

    def _published(self, future: Future, nbytes: int) -> None:
        with self._publish_lock:
            self._pending_publishes.discard(future)
            self._pending_bytes -= nbytes

    def _rows(self, request: GenerationRequest, prepared: PreparedRequest, t0: float) -> list[Sequence]:
        """The request's sequences: one, or a group of n samples (sample i seeded ``seed + i``) or
        num_beams beams sharing one event that wakes the consumer."""
        input_hash = None
        if prepared.encoder_input is not None:
            input_hash = self.encoder_input_hash(request.cache.salt, prepared.encoder_input, request.tenant)
        beams = request.beams
        count = beams.num_beams if beams.on else request.n
        # Prompt log-probabilities need logits where the prompt is computed: nothing is read.
        cache = replace(request.cache, skip_read=True) if request.prompt_logprobs else request.cache
        eos = frozenset() if request.ignore_eos else frozenset(self.spec.eos_token_ids)
        stop_ids = frozenset(request.stop_token_ids)
        request_id = request.request_id or uuid.uuid4().hex
        namespace = self.namespace(request.cache.salt, input_hash, request.tenant)
        ready = asyncio.Event()
        rows = []
        for i in range(count):
            sampling = request.sampling
            if sampling.seed is not None and i:
                sampling = replace(sampling, seed=(sampling.seed + i) % 2**64)
            adjust = None
            if LogitsAdjuster.needed(sampling, request.min_new_tokens):
                adjust = LogitsAdjuster(sampling, prepared.ids, self.spec.vocab_size, eos | stop_ids, request.min_new_tokens)
            rows.append(Sequence(
                request_id=request_id,
                prompt=prepared.ids,
                max_new_tokens=request.max_new_tokens,
                sampler=Sampler(sampling),
                eos_ids=eos,
                stop_ids=stop_ids,
                namespace=namespace,
                cache=cache,
                t0=t0,
                loop=asyncio.get_running_loop(),
                encoder_input=prepared.encoder_input,
                encoder_hash=input_hash,
                return_logits=request.return_logits,
                usage=Usage(prompt_tokens=len(prepared.ids)),
                adjust=adjust,
                logprobs=request.logprobs,
                top_logprobs=request.top_logprobs,
                prompt_logprobs=[] if request.prompt_logprobs and i == 0 else None,
                index=i,
                ready=ready,
            ))
        if count > 1:
            group = SequenceGroup(rows, BeamState(beams, eos | stop_ids) if beams.on else None,
                                  outputs=request.n if beams.on else count)
            for seq in rows:
                seq.group = group
        return rows

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Yields chunks until every sample has ended; validation errors and ``Overloaded`` raise
        before the first chunk.

        Each chunk holds every token one sample made since its previous chunk: a client that reads
        slower than tokens are made gets fewer, larger messages, and past ``max_unread_tokens`` a
        sequence pauses rather than buffering without bound. Closing the stream (cancel, deadline,
        client gone) frees every slot of the request at the scheduler's next step.
        """
        t0 = time.perf_counter()
        # Sizes first, on the loop: an oversized request is refused at once, not after waiting
        # behind other requests' tokenizing.
        self.limits.check_generation(request)
        prepared = await self._off_loop(self.tokenized, request)
        rows = self._rows(request, prepared, t0)
        self.scheduler.submit(rows)
        self.stats.started += 1
        self.stats.active += 1
        outputs = rows[: rows[0].group.outputs] if rows[0].group is not None else rows
        texts = {id(seq): TextStream(self.tokenizer, prepared.stops or (), request.include_stop_str_in_output)
                 for seq in outputs}
        ready = rows[0].ready
        open_rows = list(outputs)
        finish: FinishReason | None = None
        try:
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
                        entries = await self._off_loop(lambda e: with_text(e, self.tokenizer), seq.prompt_logprobs)
                        pieces = [entries[i : i + PROMPT_LOGPROBS_PER_CHUNK]
                                  for i in range(0, len(entries), PROMPT_LOGPROBS_PER_CHUNK)]
                        for piece in pieces[:-1]:  # ahead of the first token; the last rides with it
                            yield GenerationChunk([], "", index=seq.index, prompt_logprobs=piece)
                    chunk = self._chunk(seq, items, texts[id(seq)], request)
                    if pieces:
                        chunk.prompt_logprobs = pieces[-1]
                    if len(items) >= self.scheduler.options.max_unread_tokens:
                        self.scheduler.wake()  # it may have paused this sequence: it can decode again
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
                        open_rows.remove(seq)
                        # A stop string ends it here, not in the scheduler (which ended it already otherwise).
                        self.scheduler.abort([seq], stopped=finish is FinishReason.STOP)
                    yield chunk
        finally:
            # Reached on completion, on an error, and when the consumer is cancelled or goes away.
            self.scheduler.abort(rows)
            self.release_leases(rows)
            self.stats.active -= 1
            if not open_rows:
                self.stats.finished += 1
            else:
                self.stats.cancelled += 1
                finish = None
            self._log_request(rows[0], finish)

    def _log_request(self, seq: Sequence, finish: FinishReason | None) -> None:
        """One line per request that reached the scheduler (what it asked, what the cache gave, what
        it cost), and the same facts to every request observer (metrics). ``finish`` None: the
        stream was cancelled or failed."""
        u, t = seq.usage, seq.timings
        total_s = time.perf_counter() - seq.t0
        outcome = finish.value if finish is not None else "cancelled or failed"
        for observe in self.request_observers:
            observe(seq, outcome, total_s)
        verb = "finished" if finish is not None else "stopped"
        log.info("request %s %s after %d generated tokens (%s)", seq.request_id, verb, u.completion_tokens, outcome,
                 extra={"fields": {
                     "request_id": seq.request_id, "outcome": outcome, "prompt_tokens": u.prompt_tokens,
                     "cached_prompt_tokens": u.cached_prompt_tokens, "completion_tokens": u.completion_tokens,
                     "ttft_ms": round(t.time_to_first_token_ms, 1), "fetch_ms": round(t.cache_fetch_ms, 1),
                     "prefill_ms": round(t.prefill_ms, 1),
                     "total_ms": round(total_s * 1e3, 1),
                 }})

    def _chunk(self, seq: Sequence, items: list, text: TextStream, request: GenerationRequest) -> GenerationChunk:
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
