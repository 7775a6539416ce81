"""The HTTP face's one gRPC peer: the worker or router it fronts, over a private Unix socket.

Each HTTP request becomes calls with the caller's ``Authorization`` header as gRPC metadata (the
gRPC server checks API keys, as for any gRPC caller) and, with ``--http-timeout-s``, a deadline.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.engine.fair_share import FORWARDED_ADDRESS

MODEL_INFO_TTL_S = 30.0
"""How long the served model's name and context length are taken as known: behind a router the
fleet may be rolled to another model, and a request naming it is checked against the new name
within this long."""

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Caller:
    """What an HTTP request passes on to each gRPC call."""

    metadata: Metadata
    deadline: float | None
    """The request's deadline (``time.monotonic``), shared by every call it makes; None: none."""

    @property
    def timeout_s(self) -> float | None:
        """Seconds left to the deadline, for the next call (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    @classmethod
    def from_headers(cls, authorization: str | None, timeout_s: float, address: str | None = None) -> Caller:
        """An ``Authorization`` that gRPC metadata cannot carry (beyond printable ASCII, which no
        API key is) is not passed on: a worker with API keys answers it as a missing key (401), one
        without serves it, as any header it does not check. ``address``: the HTTP client's, which
        a worker in this process counts its fair share by (``fair_share.FORWARDED_ADDRESS``)."""
        passed = authorization and authorization.isascii() and authorization.isprintable()
        metadata = (("authorization", authorization),) if passed else ()
        if address:
            metadata += ((FORWARDED_ADDRESS, address),)
        return cls(metadata, time.monotonic() + timeout_s if timeout_s else None)


class Upstream:
    """A channel to ``target`` with the Generator and health stubs. ``max_message_bytes`` bounds
    what one response message may hold (the gRPC server's own bound on what it sends)."""

    def __init__(self, target: str, max_message_bytes: int) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", -1),
            # A stream's HTTP/2 window stays at its initial 64 KiB: with bandwidth-delay probing it
            # grows on this socket to megabytes, so a client that stops reading would leave the
            # worker's answer piling up here while the row runs on, never paused (nor ended after
            # --max-paused-s) by the worker's bound on unread tokens.
            ("grpc.http2.bdp_probe", 0),
        ])
        self._stub = pb_grpc.GeneratorStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._info: pb.GetModelInfoResponse | None = None
        self._info_at = 0.0

    def generate(self, request: pb.GenerateRequest, caller: Caller) -> grpc.aio.UnaryStreamCall:
        """The call, not yet awaited: iterate it for the messages; cancel it to end the stream at
        the worker (its slot is freed within a step)."""
        return self._stub.Generate(request, metadata=caller.metadata, timeout=caller.timeout_s)

    async def tokenize(self, request: pb.TokenizeRequest, caller: Caller) -> pb.TokenizeResponse:
        return await self._stub.Tokenize(request, metadata=caller.metadata, timeout=caller.timeout_s)

    async def model_info(self, caller: Caller, fresh: bool = False) -> pb.GetModelInfoResponse:
        """The served model; from the last answer while younger than ``MODEL_INFO_TTL_S`` unless
        ``fresh`` (a fresh call checks the caller's key, as GET /v1/models must)."""
        now = time.monotonic()
        if fresh or self._info is None or now - self._info_at > MODEL_INFO_TTL_S:
            self._info = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=caller.metadata,
                                                       timeout=10.0 if caller.timeout_s is None else caller.timeout_s)
            self._info_at = now
        return self._info

    async def serving(self) -> bool:
        """Whether the gRPC server says SERVING (a router: while one of its workers is healthy)."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()


async def messages(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[pb.GenerateResponse]:
    """The call's messages; cancels the call when the consumer stops early (a client gone)."""
    try:
        async for message in call:
            yield message
    finally:
        call.cancel()
