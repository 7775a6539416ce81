"""The HTTP server: routes, the error middleware, start and stop.

aiohttp, not FastAPI on uvicorn: one dependency that holds the server, Server-Sent Events with
back-pressure (``StreamResponse.write`` waits while the socket's buffer is full), multipart
uploads, a bound on body size, and the cancellation of a handler whose client disconnected; its
handlers run on the event loop that already runs the gRPC server, so nothing crosses threads.
Bodies are read a piece at a time within bounds (``intake``) and checked by hand (``body.Body``),
each refusal naming its field; connections are counted and their request heads timed
(``connections``); aiohttp's log of what clients did wrong is one line each (``server_log``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from pathlib import Path
from typing import TypeVar

import grpc
from aiohttp import web

from kvshare.v1 import generator_pb2 as pb
from services.http.body import Body, too_large
from services.http.chat import ChatFormat, chat_call
from services.http.choices import Choices
from services.http.completions import Echo, TextFormat, completion_calls, prompts
from services.http.connections import ConnectionGate
from services.http.errors import ApiError, bad_request, from_rpc
from services.http.intake import BodyBudget, Share, expected_bytes, may_grow, read_body, undecodable
from services.http.limits import IDLE_S, HttpLimits
from services.http.responses import Completion, respond
from services.http.server_log import ServerLog
from services.http.transcriptions import answer, read_form, transcription_call
from services.http.upstream import Caller, Upstream, messages

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

LOOP_PARSE_BYTES = 256 * 1024
"""Bodies up to this size (sent as is: not chunked nor compressed) are read without checking the
caller's key first, and parsed and translated on the event loop (about a millisecond); larger ones
only once the gRPC server has accepted the key (a fresh GetModelInfo), and on a thread, so that
other streams' tokens flow (except while ``json.loads``, one C call, holds the GIL: hence
``MAX_JSON_BYTES``)."""
MAX_JSON_BYTES = 4 * 1024 * 1024
"""The largest JSON body (the chat and text endpoints), decoded, however it is sent: room for any
context's prompt as text or token ids (a 128k-token context is about 0.5 MB of text), while parsing
the worst such body holds the loop a fraction of a second. --max-message-bytes (32 MiB by default,
for audio) bounds uploads; --http-max-buffered-bytes bounds both."""
CHAT, COMPLETIONS, TRANSCRIPTIONS = "/v1/chat/completions", "/v1/completions", "/v1/audio/transcriptions"
_MODEL_SHOWN = 64
"""Characters of an unknown model name repeated in the 404's message."""
BODIES = web.AppKey("bodies", BodyBudget)
UPLOAD_BOUND = web.AppKey("upload_bound", tuple)
"""(bytes, the name of the bound) of an upload: what aiohttp's multipart reader reads at most."""
SHARE = web.RequestKey("share", Share)
"""The request's part of ``BODIES``."""


def tls_context(cert_file: Path, key_file: Path, client_ca_file: Path | None) -> ssl.SSLContext:
    """The HTTP port's TLS, as the gRPC port's: the same certificate, and with a client CA,
    client certificates required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=client_ca_file)
    return context


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every refusal as OpenAI's error object; a bug as a 500 that says so, logged. The request's
    head has arrived: its connection's header deadline is off while it is served, and its body's
    bytes count against the face's ``BodyBudget`` (``request[SHARE]``) until it is answered."""
    try:
        with ConnectionGate.serving(request.transport), request.app[BODIES].share() as share:
            request[SHARE] = share
            return await handler(request)
    except ApiError as exc:
        # Without its traceback: that holds this frame, which holds ``error`` (a cycle that kept the
        # frames of the request, its body among them, until the garbage collector ran).
        error = exc.with_traceback(None)
    except grpc.aio.AioRpcError as exc:
        error = from_rpc(exc)
    except web.HTTPRequestEntityTooLarge:
        error = too_large(*request.app[UPLOAD_BOUND])
    except web.RequestPayloadError as exc:  # a body that does not decode, or chunks that break off
        error = undecodable(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", "invalid_request_error",
                         code=exc.reason.lower().replace(" ", "_"))
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client left: nobody to answer
    except Exception as exc:  # noqa: BLE001 - a bug of this face still answers in OpenAI's shape
        log.error("internal error answering %s %s", request.method, request.path, exc_info=exc)
        error = ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
    return web.json_response(error.body(), status=error.status, headers=error.headers)


class HttpFace:
    """The OpenAI-compatible API in front of ``upstream``, within ``limits``. ``bodies``: the
    bytes request bodies hold now; ``gate``: the open connections."""

    def __init__(self, upstream: Upstream, limits: HttpLimits) -> None:
        self.upstream = upstream
        self.limits = limits
        self.bodies = BodyBudget(limits.max_buffered_bytes)
        # One big body is parsed at a time: ``json.loads`` holds the GIL for all of its C call (about
        # 60 ms for 4 MiB here), so parsed side by side on many threads they passed the GIL among
        # themselves and 16 trickled bodies that ended together held the loop for a second.
        self._parsing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-parse")
        self.gate = ConnectionGate(limits.max_connections, limits.header_timeout_s)
        # Each body's bound, and the flag that sets it: the smallest that applies.
        upload = (limits.max_body_bytes, "the server's --max-message-bytes")
        shared = (limits.max_buffered_bytes, "the server's --http-max-buffered-bytes")
        self._json_bound = min((MAX_JSON_BYTES, "JSON bodies"), upload, shared, key=itemgetter(0))
        self._upload_bound = min(upload, shared, key=itemgetter(0))
        # client_max_size: what aiohttp's own multipart reader reads at most (the uploads).
        self.app = web.Application(middlewares=[openai_errors], client_max_size=self._upload_bound[0])
        self.app[UPLOAD_BOUND] = self._upload_bound
        self.app[BODIES] = self.bodies
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post(CHAT, self.chat),
            web.post(COMPLETIONS, self.completions),
            web.post(TRANSCRIPTIONS, self.transcriptions),
        ])
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Listens; returns the port (``port`` 0 picks a free one). OSError when it cannot bind."""
        # handler_cancellation: a client that disconnects cancels its handler, and so its gRPC calls
        # (and gives its body's bytes back). keepalive_timeout: aiohttp closes a connection that
        # sends no request for this long.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, keepalive_timeout=IDLE_S,
                                     logger=ServerLog())
        await self._runner.setup()
        # Our own listener, not a web.TCPSite: its protocol factory is the connection gate's.
        self._listener = await asyncio.get_running_loop().create_server(
            self.gate.factory(self._runner.server), host, port, ssl=tls, backlog=128,
            ssl_handshake_timeout=self.limits.header_timeout_s if tls is not None else None)
        return self._listener.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.upstream.close()
        self._parsing.shutdown(wait=False)

    def _caller(self, request: web.Request) -> Caller:
        return Caller.from_headers(request.headers.get("Authorization"), self.limits.timeout_s, request.remote)

    async def _admit(self, request: web.Request, caller: Caller, limit: int, what: str) -> None:
        """Before a body is read: 400 for a ``Content-Encoding`` that cannot be decoded, 413 for
        one announced over ``limit``, and for one that may be big (over ``LOOP_PARSE_BYTES``,
        chunked or compressed), the caller's key checked first, so that nobody without a key
        makes the server buffer or parse megabytes."""
        length = request.content_length
        if length is not None and length > limit:
            raise too_large(limit, what)
        if may_grow(request) or length > LOOP_PARSE_BYTES:
            await self.upstream.model_info(caller, fresh=True)

    async def _translated(self, request: web.Request, caller: Caller, build: Callable[[Body], T]) -> T:
        """``build(body)`` of the request's JSON body, bounded by ``MAX_JSON_BYTES``."""
        limit, what = self._json_bound
        await self._admit(request, caller, limit, what)
        raw = await self._in_time(read_body(request, limit, what, request[SHARE]))

        def translate(data: bytes) -> T:
            body = Body.parse(data)
            body.refuse_unsupported()
            return build(body)

        # The loop also carries every other stream's tokens: a big body is translated on a thread.
        if len(raw) <= LOOP_PARSE_BYTES:
            return translate(raw)
        return await asyncio.get_running_loop().run_in_executor(self._parsing, translate, raw)

    async def _in_time(self, reading: Awaitable[R]) -> R:
        """``reading`` (of a body), 408 unless done within ``limits.body_timeout_s``: a client
        trickling bytes in holds a connection and its buffer, not the server, forever."""
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await reading
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                           "(--http-body-timeout-s)", code="timeout") from None

    async def _served(self, asked: str | None, caller: Caller, endpoint: str) -> pb.GetModelInfoResponse:
        """The served model; 404 when the request names another, 400 when it cannot answer at
        ``endpoint`` (text to a speech model, audio to a text model, chat without a template)."""
        info = await self.upstream.model_info(caller)
        if asked is not None and asked != info.name:
            info = await self.upstream.model_info(caller, fresh=True)  # the fleet may have moved on
            if asked != info.name:
                raise ApiError(404, f"the model {asked[:_MODEL_SHOWN]!r} does not exist here: GET /v1/models lists "
                               "the model this server serves", "invalid_request_error", "model", "model_not_found")
        if info.audio_input and endpoint != TRANSCRIPTIONS:
            raise bad_request("model", f"{info.name} is a speech model: POST its audio to {TRANSCRIPTIONS}")
        if not info.audio_input and endpoint == TRANSCRIPTIONS:
            raise bad_request("model", f"{info.name} takes no audio: send text to {CHAT} or {COMPLETIONS}")
        if endpoint == CHAT and not info.chat_template:
            raise bad_request("messages", f"{info.name} has no chat template: send a prompt to {COMPLETIONS}")
        return info

    async def health(self, request: web.Request) -> web.Response:
        if await self.upstream.serving():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [await self._model_card(request)]})

    async def model(self, request: web.Request) -> web.Response:
        card = await self._model_card(request)
        if request.match_info["model"] != card["id"]:
            raise ApiError(404, "no such model: GET /v1/models lists the model this server serves",
                           "invalid_request_error", "model", "model_not_found")
        return web.json_response(card)

    async def _model_card(self, request: web.Request) -> dict:
        info = await self.upstream.model_info(self._caller(request), fresh=True)
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "kvshare",
                "max_model_len": info.context_length}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        caller, request_id = self._caller(request), f"chatcmpl-{uuid.uuid4().hex}"
        body, call = await self._translated(request, caller, lambda b: (b, chat_call(b, request_id)))
        stream = body.boolean("stream")
        model = (await self._served(body.string("model"), caller, CHAT)).name
        completion = Completion(request_id, model, [call], call.n, stream, _include_usage(body, stream))
        return await respond(request, self.upstream, caller, completion, ChatFormat(call.logprobs))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        caller, request_id = self._caller(request), f"cmpl-{uuid.uuid4().hex}"

        def build(body: Body):
            found = prompts(body)
            return body, found, completion_calls(body, request_id, found)

        body, found, calls = await self._translated(request, caller, build)
        stream = body.boolean("stream")
        model = (await self._served(body.string("model"), caller, COMPLETIONS)).name
        echoes = None
        if body.boolean("echo"):
            echoes = [await self._echo(p.text, p.token_ids, calls[0].prompt_logprobs, caller) for p in found]
        completion = Completion(request_id, model, calls, calls[0].n, stream, _include_usage(body, stream))
        return await respond(request, self.upstream, caller, completion,
                             TextFormat(calls[0].n, calls[0].logprobs, echoes))

    async def _echo(self, text: str | None, token_ids: list[int] | None, first_token: bool, caller: Caller) -> Echo:
        """A prompt's echo: its text (token ids decoded by the worker) and, for echoed
        log-probabilities, its first token's text."""
        if text is None:
            text = (await self.upstream.tokenize(pb.TokenizeRequest(token_ids=token_ids), caller)).text
        first = ""
        if first_token:
            ids = token_ids or (await self.upstream.tokenize(pb.TokenizeRequest(text=text), caller)).token_ids
            first = (await self.upstream.tokenize(pb.TokenizeRequest(token_ids=ids[:1]), caller)).text if ids else ""
        return Echo(text, first)

    async def transcriptions(self, request: web.Request) -> web.Response:
        caller = self._caller(request)
        limit, what = self._upload_bound
        await self._admit(request, caller, limit, what)
        # aiohttp's multipart reader reads the upload (at most ``limit``, client_max_size): it is
        # charged what it may hold before it is read.
        request[SHARE].take(expected_bytes(request, limit))
        form = await self._in_time(read_form(request))
        await self._served(form.model, caller, TRANSCRIPTIONS)
        call = transcription_call(form, f"trsc-{uuid.uuid4().hex}")
        choices = Choices(1)
        async for message in messages(self.upstream.generate(call, caller)):
            choices.add(0, message)
        return answer(form, choices)


def _include_usage(body: Body, stream: bool) -> bool:
    options = body.object("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options", "only allowed when stream is true")
    return options.boolean("include_usage")
