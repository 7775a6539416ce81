"""Runs a completion's gRPC calls and answers with one JSON object or an event stream; the chat
and text formats (``chat.ChatFormat``, ``completions.TextFormat``) say what each holds.

A refusal before the first event leaves with its own status code (a stream's ``200`` is only
sent with its first event); one after it, as an error event. A client that disconnects cancels
the handler (aiohttp's ``handler_cancellation``), which cancels every gRPC call of the request:
the worker frees their rows within a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import grpc
from aiohttp import web

from kvshare.v1 import generator_pb2 as pb
from services.http.choices import Choice, Choices, merged
from services.http.errors import from_rpc
from services.http.sse import EventStream
from services.http.upstream import Caller, Upstream, messages


class Format(Protocol):
    object_name: str
    chunk_name: str

    def delta(self, prompt: int, choice: Choice, message: pb.GenerateResponse, first: bool) -> list[dict]:
        """The stream entries (``choices`` items) for ``message`` of ``choice``, possibly none
        (a message that carries nothing the format shows) or several (held ones released)."""

    def choice(self, choice: Choice, choices: Choices) -> dict:
        """The finished ``choice`` (one of ``choices``) in the whole response."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One request's gRPC calls (one per prompt) and how to answer."""

    request_id: str
    model: str
    calls: list[pb.GenerateRequest]
    n: int
    stream: bool
    include_usage: bool


async def respond(request: web.Request, upstream: Upstream, caller: Caller, completion: Completion,
                  fmt: Format) -> web.StreamResponse:
    streams = [messages(upstream.generate(call, caller)) for call in completion.calls]
    choices = Choices(completion.n)
    head = {"id": completion.request_id, "object": fmt.chunk_name, "created": int(time.time()), "model": completion.model}
    if not completion.stream:
        async for prompt, message in merged(streams):
            choices.add(prompt, message)
        return web.json_response({**head, "object": fmt.object_name,
                                  "choices": [fmt.choice(c, choices) for c in choices.in_order()], "usage": choices.usage()})
    events = EventStream(request)
    usage = {"usage": None} if completion.include_usage else {}
    opened = False
    try:
        async for prompt, message in merged(streams):
            first = choices.index(prompt, message) not in choices.by_index
            entries = fmt.delta(prompt, choices.add(prompt, message), message, first)
            if not entries:
                continue
            if not opened:
                await events.open()
                opened = True
            for entry in entries:
                await events.send({**head, "choices": [entry], **usage})
    except grpc.aio.AioRpcError as err:
        if not opened:
            raise
        await events.fail(from_rpc(err))
        return events.response
    if not opened:
        await events.open()
    if completion.include_usage:
        await events.send({**head, "choices": [], "usage": choices.usage()})
    await events.done()
    return events.response
