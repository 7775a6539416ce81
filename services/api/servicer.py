"""The gRPC face of the engine: converts messages, maps domain errors to status codes, streams.

It holds no generation logic. With API keys configured, every Generator call must carry a known key
(the health and reflection services stay open for probes); its tenant enters the request. Status
codes: Unauthenticated -> UNAUTHENTICATED, InvalidRequest -> INVALID_ARGUMENT, RequestOutOfRange
-> OUT_OF_RANGE, FailedPrecondition (messages without a chat template) -> FAILED_PRECONDITION,
Overloaded (every slot busy and the queue full) -> RESOURCE_EXHAUSTED, Unavailable (the scheduler
stopped: the worker is exiting) -> UNAVAILABLE, anything unexpected -> INTERNAL (a bug, logged with
its traceback). ``door`` refuses a call its engine would refuse before the call's body is read.
Oversized messages never get here: gRPC refuses them with RESOURCE_EXHAUSTED; nor do requests that
do not parse, nor a TokenizeRequest larger than any valid one (``size_check``, before it is
parsed): services/api/method_handlers.py answers them INVALID_ARGUMENT. A call counts against its client's fair share (its tenant, else its
address: ``fair_share.client_of``).

Converting a message costs the event loop O(its size); repeated fields are handed to the engine as
they are, or cut one past the engine's limit, so that a request of a million stop strings or
messages is refused before a million Python objects are made for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc

from cachestore.ratelimit import RateLimitedLog
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.api_keys import ApiKeys
from services.engine.door import Ticket
from services.engine.encoder_input import EncoderFeatures, EncoderRequest
from services.engine.engine import Engine
from services.engine.fair_share import FORWARDED_ADDRESS, client_of
from services.engine.generation import (
    BeamSearch,
    CacheControl,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    TokenizeRequest,
    TokenizeResult,
    TokenLogprob,
)
from services.engine.request_limits import MAX_MESSAGES, MAX_STOP_TOKEN_IDS, MAX_SUPPRESS_TOKEN_IDS
from services.engine.sampling import SamplingConfig
from services.errors import (
    FailedPrecondition,
    InvalidRequest,
    Overloaded,
    RequestOutOfRange,
    Unauthenticated,
    Unavailable,
)
from services.runtime.chat_template import Message

log = logging.getLogger(__name__)
# One line per 10 s with a count of the rest: a scan of keys must not flood the log.
_refused = RateLimitedLog(log)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name

IDS_PER_PIECE = 32768

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def status_for(exc: Exception) -> grpc.StatusCode:
    """The one place where domain errors become gRPC status codes."""
    if isinstance(exc, RequestOutOfRange):
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    code = status_for(exc)
    message = str(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    await context.abort(code, message)


def chat_messages(messages) -> list[Message]:
    """At most one past the engine's limit: enough for it to refuse the request."""
    return [Message(m.role, m.content) for m in messages[: MAX_MESSAGES + 1]]


NO_IDS = -1
"""suppress_token_ids / begin_suppress_token_ids holding only this id: none, not the folder's default."""


def suppressed_ids(ids) -> list[int] | None:
    """A suppress field: None when unset (the folder's default), [] for ``[NO_IDS]``, else the ids,
    at most one past the engine's limit (enough for it to refuse the request)."""
    if not ids:
        return None
    if len(ids) == 1 and ids[0] == NO_IDS:
        return []
    return list(ids[: MAX_SUPPRESS_TOKEN_IDS + 1])


def engine_request(request: pb.GenerateRequest, max_stop_strings: int, tenant: str = "",
                   client: str = "", deadline: float | None = None) -> GenerationRequest:
    sampling = request.sampling
    return GenerationRequest(
        prompt=request.prompt or None,
        prompt_token_ids=request.prompt_token_ids or None,
        messages=chat_messages(request.messages) or None,
        max_new_tokens=request.max_new_tokens,
        sampling=SamplingConfig(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
            seed=sampling.seed if sampling.HasField("seed") else None,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
        ),
        stop=list(request.stop[: max_stop_strings + 1]),
        ignore_eos=request.ignore_eos,
        request_id=request.request_id,
        encoder=EncoderRequest(
            prompt=request.encoder_prompt or None,
            token_ids=request.encoder_prompt_token_ids or None,
            features=EncoderFeatures(
                shape=request.encoder_features.shape, dtype=request.encoder_features.dtype,
                data=request.encoder_features.data,
            ) if request.HasField("encoder_features") else None,
            audio=request.encoder_audio or None,
        ),
        cache=CacheControl(
            skip_read=request.cache.skip_read, skip_write=request.cache.skip_write, salt=request.cache.salt
        ),
        tenant=tenant,
        client=client,
        deadline=deadline,
        min_new_tokens=request.min_new_tokens,
        stop_token_ids=list(request.stop_token_ids[: MAX_STOP_TOKEN_IDS + 1]),
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        prompt_logprobs=request.prompt_logprobs,
        n=request.n or 1,
        beams=BeamSearch(
            num_beams=request.num_beams or 1,
            length_penalty=request.length_penalty if request.HasField("length_penalty") else 1.0,
            early_stopping=request.early_stopping,
        ),
        suppress_token_ids=suppressed_ids(request.suppress_token_ids),
        begin_suppress_token_ids=suppressed_ids(request.begin_suppress_token_ids),
    )


def tokenize_response(result: TokenizeResult) -> bytes:
    """The serialized response, made on a tokenizer thread in pieces of ``IDS_PER_PIECE`` ids. Each
    piece holds the GIL about a millisecond, so the scheduler thread is never kept from it for long
    by a call answering a million ids (serialized whole, on the loop, the message held it 16 ms).
    Serialized messages concatenate into their merge, and a repeated field's pieces into the whole
    field, so the bytes are those of one TokenizeResponse."""
    pieces = [pb.TokenizeResponse(text=result.text).SerializeToString()]
    for start in range(0, len(result.token_ids), IDS_PER_PIECE):
        pieces.append(pb.TokenizeResponse(token_ids=result.token_ids[start : start + IDS_PER_PIECE]).SerializeToString())
    return b"".join(pieces)


def _logprobs(entries: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob, text=e.text,
                            top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob, text=t.text) for t in e.top])
            for e in entries]


def response_message(chunk: GenerationChunk) -> pb.GenerateResponse:
    message = pb.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text, index=chunk.index,
                                  logprobs=_logprobs(chunk.logprobs), prompt_logprobs=_logprobs(chunk.prompt_logprobs))
    if chunk.finish_reason is not None:
        message.finish_reason = _FINISH[chunk.finish_reason]
        if isinstance(chunk.matched_stop, str):
            message.matched_stop_str = chunk.matched_stop
        elif chunk.matched_stop is not None:
            message.matched_stop_token_id = chunk.matched_stop
        if chunk.beam_score is not None:
            message.beam_score = chunk.beam_score
        u, t = chunk.usage, chunk.timings
        message.usage.CopyFrom(pb.Usage(
            prompt_tokens=u.prompt_tokens, cached_prompt_tokens=u.cached_prompt_tokens,
            completion_tokens=u.completion_tokens, encoder_cache_hit=u.encoder_cache_hit,
        ))
        message.timings.CopyFrom(pb.Timings(
            time_to_first_token_ms=t.time_to_first_token_ms, prefill_ms=t.prefill_ms,
            cache_fetch_ms=t.cache_fetch_ms, total_ms=t.total_ms,
        ))
    return message


class GeneratorServicer(pb_grpc.GeneratorServicer):
    def __init__(self, engine: Engine, api_keys: ApiKeys | None = None) -> None:
        self._engine = engine
        self._api_keys = api_keys

    def size_check(self, method: str) -> Callable[[int], str | None] | None:
        """Tokenize's bound on its request bytes, checked before they are parsed
        (``RequestLimits.tokenize_request_bytes``); other methods: None (the message limit)."""
        if method != "Tokenize":
            return None
        limits = self._engine.limits
        most = limits.tokenize_request_bytes

        def check(size: int) -> str | None:
            if size <= most:
                return None
            return (f"a TokenizeRequest of {size} bytes; at most {most} bytes hold a valid one (at most "
                    f"{limits.prompt_bytes} bytes of text or messages, or {limits.token_ids} token_ids, the model's "
                    "context length): send it in parts")

        return check

    async def admit(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts the call UNAUTHENTICATED unless it carries a known API key (when keys are configured)."""
        try:
            self._tenant(context)
        except Unauthenticated as exc:
            _refused.warning("refused a call without a valid API key from %s", context.peer())
            await _abort(context, exc)

    async def door(self, method: str, context: grpc.aio.ServicerContext) -> Ticket | None:
        """Before the call's body is read: aborts it RESOURCE_EXHAUSTED when the engine would refuse
        it anyway (``Engine.door``), else returns the place it holds (None for GetModelInfo)."""
        if method == "GetModelInfo":
            return None
        tenant = self._tenant(context)
        try:
            return self._engine.door(self._client(context, tenant), generate=method == "Generate")
        except (Overloaded, Unavailable) as exc:
            await _abort(context, exc)

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant ("" without API keys); raises Unauthenticated."""
        if self._api_keys is None:
            return ""
        tenant = self._api_keys.tenant(context.invocation_metadata() or ())
        if tenant is None:
            raise Unauthenticated("missing or unknown API key: send the metadata 'authorization: Bearer KEY' "
                                  "with a key the worker's --api-keys-file lists")
        return tenant

    def client(self, context: grpc.aio.ServicerContext) -> str:
        """Whose fair share an admitted call counts against (``fair_share.client_of``)."""
        return self._client(context, self._tenant(context))

    @staticmethod
    def _client(context: grpc.aio.ServicerContext, tenant: str) -> str:
        """Whose fair share the call counts against (``fair_share.client_of``)."""
        forwarded = next((v for k, v in context.invocation_metadata() or () if k == FORWARDED_ADDRESS), None)
        return client_of(tenant, context.peer() or "", forwarded if isinstance(forwarded, str) else None)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       place: Ticket | None = None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            # aclosing: when the call is cancelled while this handler waits to send, the engine's
            # stream is closed now (halting its token loop), not whenever it is collected.
            tenant = self._tenant(context)
            left = context.time_remaining()
            generation = engine_request(request, self._engine.limits.stop_strings, tenant, self._client(context, tenant),
                                        None if left is None else time.monotonic() + left)
            # Neither the message nor its conversion is kept for the stream's life: an audio
            # request's bytes are let go once the engine has prepared it.
            del request
            stream = self._engine.generate(generation, place)
            del generation
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    yield response_message(chunk)
        except Exception as exc:  # noqa: BLE001 - every error leaves as a status, never as UNKNOWN
            await _abort(context, exc)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext,
                       place: Ticket | None = None) -> bytes:
        try:
            tenant = self._tenant(context)
            return await self._engine.tokenize(TokenizeRequest(
                text=request.text or None, token_ids=request.token_ids or None,
                messages=chat_messages(request.messages) or None,
            ), tokenize_response, place, self._client(context, tenant))
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext,
                           place: None = None) -> pb.GetModelInfoResponse:
        spec, session = self._engine.spec, self._engine.session
        return pb.GetModelInfoResponse(
            name=spec.name,
            fingerprint=spec.fingerprint,
            num_layers=spec.num_layers,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            context_length=spec.context_length,
            vocab_size=spec.vocab_size,
            kv_bytes_per_token=spec.kv_bytes_per_token(session.kv_dtype.itemsize),
            block_size=self._engine.options.block_size,
            encoder_decoder=spec.encoder is not None,
            execution_provider=session.execution_provider,
            cache_dtype=self._engine.storage_dtype.name,
            cached_bytes_per_token=spec.kv_bytes_per_token(self._engine.storage_dtype.itemsize),
            device=session.device_name,
            slots=self._engine.scheduler.options.max_batch,
            slot_bytes=self._engine.slot_bytes,
            chat_template=self._engine.inputs.chat_template is not None,
            audio_input=self._engine.spec.audio is not None,
            layer_groups=[pb.LayerGroup(layers=group.layers, window=group.window,
                                        kv_bytes_per_token=spec.kv_bytes_per_token(session.kv_dtype.itemsize,
                                                                                   len(group.layers)),
                                        cached_bytes_per_token=spec.kv_bytes_per_token(
                                            self._engine.storage_dtype.itemsize, len(group.layers)),
                                        fetched_over_window=group.window > 0 and self._engine.prefix.geometry.window > 0)
                          for group in spec.layer_groups],
            device_memory=self._device_memory(),
        )

    def _device_memory(self) -> pb.DeviceMemory | None:
        budget = self._engine.session.device.budget
        if budget is None:
            return None
        return pb.DeviceMemory(free_bytes=budget.free, reserve_bytes=budget.reserve, arena_bytes=budget.arenas,
                               bank_bytes=budget.bank)
