"""The HTTP server: routes, the error middleware, start and stop.

aiohttp, not FastAPI on uvicorn: one dependency that holds the server, Server-Sent Events with
back-pressure (``StreamResponse.write`` waits while the socket's buffer is full), multipart
uploads, a bound on body size, and the cancellation of a handler whose client disconnected; its
handlers run on the event loop that already runs the gRPC server, so nothing crosses threads.
Bodies are read and checked by hand (``body.Body``), each refusal naming its field.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
from aiohttp import web

from kvshare.v1 import generator_pb2 as pb
from services.http.body import Body, too_large
from services.http.chat import ChatFormat, chat_call
from services.http.choices import Choices
from services.http.completions import Echo, TextFormat, completion_calls, prompts
from services.http.errors import ApiError, bad_request, from_rpc
from services.http.responses import Completion, respond
from services.http.transcriptions import answer, read_form, transcription_call
from services.http.upstream import Caller, Upstream, messages

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

LOOP_PARSE_BYTES = 256 * 1024
"""Bodies up to this size are read without checking the caller's key first, and parsed and
translated on the event loop (about a millisecond); larger ones only once the gRPC server has
accepted the key (a fresh GetModelInfo), and on a thread, so that other streams' tokens flow
(except while ``json.loads``, one C call, holds the GIL: hence ``MAX_JSON_BYTES``)."""
MAX_JSON_BYTES = 4 * 1024 * 1024
"""The largest JSON body (the chat and text endpoints): room for any context's prompt as text or
token ids (a 128k-token context is about 0.5 MB of text), while parsing the worst such body holds
the loop a fraction of a second. --max-message-bytes (32 MiB by default, for audio) bounds uploads."""
BODY_READ_S = 60.0
"""A body must arrive within this long once its headers have: a client trickling bytes in holds a
connection and its buffer, not the server, forever (408)."""
CHAT, COMPLETIONS, TRANSCRIPTIONS = "/v1/chat/completions", "/v1/completions", "/v1/audio/transcriptions"
_MODEL_SHOWN = 64
"""Characters of an unknown model name repeated in the 404's message."""


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
    """Every refusal as OpenAI's error object; a bug as a 500 that says so, logged."""
    try:
        return await handler(request)
    except ApiError as exc:
        error = exc
    except grpc.aio.AioRpcError as exc:
        error = from_rpc(exc)
    except web.HTTPRequestEntityTooLarge:
        error = too_large(request.app["max_body_bytes"])
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
    """The OpenAI-compatible API in front of ``upstream``. ``timeout_s``: each request's
    deadline (0: none); ``max_body_bytes``: the largest request body (413 past it)."""

    def __init__(self, upstream: Upstream, timeout_s: float, max_body_bytes: int) -> None:
        self.upstream = upstream
        self.timeout_s = timeout_s
        self.app = web.Application(middlewares=[openai_errors], client_max_size=max_body_bytes)
        self.app["max_body_bytes"] = max_body_bytes
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post(CHAT, self.chat),
            web.post(COMPLETIONS, self.completions),
            web.post(TRANSCRIPTIONS, self.transcriptions),
        ])
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Listens; returns the port (``port`` 0 picks a free one). OSError when it cannot bind."""
        # handler_cancellation: a client that disconnects cancels its handler, and so its gRPC calls.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls, reuse_port=False)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.upstream.close()

    def _caller(self, request: web.Request) -> Caller:
        return Caller.from_headers(request.headers.get("Authorization"), self.timeout_s, request.remote)

    async def _admit(self, request: web.Request, caller: Caller, limit: int, what: str) -> None:
        """Before a body is read: 413 for one announced over ``limit``, and for one that may be
        big (over ``LOOP_PARSE_BYTES`` or of unknown length), the caller's key checked first, so
        that nobody without a key makes the server buffer or parse megabytes."""
        length = request.content_length
        if length is not None and length > limit:
            raise too_large(limit, what)
        if length is None or length > LOOP_PARSE_BYTES:
            await self.upstream.model_info(caller, fresh=True)

    async def _translated(self, request: web.Request, caller: Caller, build: Callable[[Body], T]) -> T:
        """``build(body)`` of the request's JSON body, bounded by ``MAX_JSON_BYTES``."""
        limit = min(MAX_JSON_BYTES, self.app["max_body_bytes"])
        what = "JSON bodies" if limit == MAX_JSON_BYTES else "the server's --max-message-bytes"
        await self._admit(request, caller, limit, what)
        raw = await _read_in_time(request.read())
        if len(raw) > limit:
            raise too_large(limit, what)

        def translate(data: bytes) -> T:
            body = Body.parse(data)
            body.refuse_unsupported()
            return build(body)

        # The loop also carries every other stream's tokens: a big body is translated on a thread.
        return translate(raw) if len(raw) <= LOOP_PARSE_BYTES else await asyncio.to_thread(translate, raw)

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
        await self._admit(request, caller, self.app["max_body_bytes"], "the server's --max-message-bytes")
        form = await _read_in_time(read_form(request))
        await self._served(form.model, caller, TRANSCRIPTIONS)
        call = transcription_call(form, f"trsc-{uuid.uuid4().hex}")
        choices = Choices(1)
        async for message in messages(self.upstream.generate(call, caller)):
            choices.add(0, message)
        return answer(form, choices)


async def _read_in_time(reading: Awaitable[R]) -> R:
    try:
        async with asyncio.timeout(BODY_READ_S):
            return await reading
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_READ_S:.0f} s", code="timeout") from None


def _include_usage(body: Body, stream: bool) -> bool:
    options = body.object("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options", "only allowed when stream is true")
    return options.boolean("include_usage")
