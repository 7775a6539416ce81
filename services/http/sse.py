"""Server-Sent Events as OpenAI streams them: ``data: {json}`` events, then ``data: [DONE]``.

Back-pressure: ``send`` returns once the event is in the socket's buffer, and waits while that
buffer is full, so a client that stops reading stops the stream's reads from the worker (whose
gRPC flow control, then its own bound on unread tokens, pauses the row); nothing grows with it.
"""

from __future__ import annotations

import json

from aiohttp import web

from services.http.errors import ApiError


class EventStream:
    """A streamed response, opened once the first event is ready: until then a refusal can still
    leave with its own status code."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            # Proxies (nginx) must pass each event on as it comes, not buffer the stream.
            "X-Accel-Buffering": "no",
        })

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, event: dict) -> None:
        await self.response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")

    async def fail(self, error: ApiError) -> None:
        """A refusal after the stream began (the status is sent): an error event, as vLLM and
        OpenAI send one; the OpenAI clients raise it as an ``APIError``."""
        await self.send(error.body())
        await self.done()

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
