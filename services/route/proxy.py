"""Forwards every method of ``kvshare.v1.Generator`` to a worker, as raw bytes.

What passes through unchanged: the request bytes (only a Generate request is parsed, for its
routing key), the caller's metadata (``authorization`` included; gRPC's own headers are set again by
the router's channel), the time left to the caller's deadline, every response message as soon as
it arrives, and the worker's status code, details and trailing metadata. A caller that cancels
cancels the worker's call.

A worker cannot hold a call longer than the router's bounds (``attempt``): its first response
message within ``--first-response-timeout-s``, a stream's next message within
``--stream-idle-timeout-s``, and a health check that gets no answer cuts the calls it had left
silent. A call that has passed nothing to its caller yet when its worker fails UNAVAILABLE or is
cut off is tried once more on the next-best worker (an UNAVAILABLE worker is marked unhealthy
meanwhile); the caller never sees the first try. One that has passed messages on ends UNAVAILABLE
with details naming the worker, what happened and how many messages the caller got: the output was
cut off, and only the caller can tell whether to ask again.

The router's own statuses: UNAVAILABLE "no healthy worker among N", UNAVAILABLE naming a worker that
was cut off or failed mid-stream, and INTERNAL for a bug of its own (logged with its traceback);
never UNKNOWN, and never INTERNAL for a worker's error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from kvshare.v1 import generator_pb2 as pb
from services.route.attempt import Attempt, Cut, Limits
from services.route.rendezvous import RoundRobin, choose
from services.route.routing_key import routing_key
from services.route.upstreams import GENERATOR_SERVICE, Upstream, UpstreamSet

log = logging.getLogger(__name__)

ATTEMPTS = 2
"""A call goes to at most two workers: the first choice and, after an UNAVAILABLE or a cut before it
answered, the next-best."""

# Metadata the router's own channel sets; passing the caller's copy on would duplicate or clash.
_NOT_FORWARDED = ("user-agent",)
_RESERVED_PREFIXES = ("grpc-", ":")


def _forwardable(metadata) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, v) for k, v in metadata or () if k not in _NOT_FORWARDED and not k.startswith(_RESERVED_PREFIXES))


class Proxy:
    """The router's Generator methods. ``prefix_bytes``: ``RouteSettings.route_prefix_bytes``;
    ``max_streams``: ``RouteSettings.max_streams_per_worker`` (0: no bound); ``limits``: how long
    a worker may keep a call waiting."""

    def __init__(self, upstreams: UpstreamSet, prefix_bytes: int, max_streams: int, limits: Limits) -> None:
        self._upstreams = upstreams
        self._prefix_bytes = prefix_bytes
        self._max_streams = max_streams
        self._limits = limits
        self._round_robin = RoundRobin()

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """One handler per method of the service descriptor, bytes in and bytes out (no
        serializers: gRPC hands over and takes the raw message). Generate is keyed by its prompt;
        the other methods go round-robin."""
        handlers = {}
        for method in pb.DESCRIPTOR.services_by_name["Generator"].methods:
            if method.client_streaming:
                raise TypeError(f"{method.full_name}: client-streaming methods are not forwarded")
            make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
            handlers[method.name] = make(self._handler(f"/{GENERATOR_SERVICE}/{method.name}", method.name == "Generate",
                                                       method.server_streaming))
        return handlers

    def _handler(self, path: str, keyed: bool, streaming: bool) -> Callable[..., Awaitable[bytes | None]]:
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes | None:
            try:
                return await self._forward(path, request, context, keyed, streaming)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - a router bug still leaves as a status, never UNKNOWN
                log.error("internal error forwarding %s", path, exc_info=exc)
                await context.abort(grpc.StatusCode.INTERNAL, f"router internal error: {type(exc).__name__}: {exc}")

        return forward

    def _pick(self, key: bytes | None, tried: list[Upstream]) -> Upstream | None:
        healthy = [u for u in self._upstreams.healthy() if u not in tried]
        return self._round_robin.choose(healthy) if key is None else choose(key, healthy, self._max_streams)

    async def _forward(self, path: str, request: bytes, context: grpc.aio.ServicerContext, keyed: bool,
                       streaming: bool) -> bytes | None:
        """Sends the call to its worker and passes the answer on: a streaming call's messages one
        by one through ``context.write`` (returns None), a unary call's response as it returns."""
        metadata = _forwardable(context.invocation_metadata())
        key = routing_key(request, metadata, self._prefix_bytes) if keyed else None
        tried: list[Upstream] = []
        cut: Cut | None = None
        while len(tried) < ATTEMPTS and (upstream := self._pick(key, tried)) is not None:
            tried.append(upstream)
            attempt = Attempt(upstream.address, self._limits)
            with self._upstreams.using(upstream, streaming, attempt) as channel:
                call = (channel.unary_stream if streaming else channel.unary_unary)(path)(
                    request, metadata=metadata, timeout=context.time_remaining())
                sent = 0
                try:
                    response = None
                    if streaming:
                        # context.write, not a generator's yield: a caller who cancels cancels this
                        # coroutine at once, so the finally below cancels the worker's call now, not
                        # when a suspended generator is collected.
                        while (message := await attempt.receive(call.read)) is not grpc.aio.EOF:
                            await context.write(message)
                            sent += 1
                    else:
                        response = await attempt.receive(lambda call=call: call)
                    context.set_trailing_metadata(_forwardable(await call.trailing_metadata()))
                    return response
                except Cut as err:
                    if sent:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{err.why}: {_cut_off(sent)}")
                    log.warning("%s: %s; trying the next-best worker", path, err.why)
                    cut = err
                except grpc.aio.AioRpcError as err:
                    if err.code() is grpc.StatusCode.UNAVAILABLE:
                        if sent:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {upstream.address} failed "
                                                f"mid-stream ({err.details()}): {_cut_off(sent)}",
                                                _forwardable(err.trailing_metadata()))
                        await self._upstreams.mark_unhealthy(upstream, f"{err.code().name}: {err.details()}")
                        if len(tried) < ATTEMPTS:
                            continue
                    await context.abort(err.code(), err.details() or "", _forwardable(err.trailing_metadata()))
                finally:
                    call.cancel()
        if cut is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{cut.why}; " + (
                f"tried {len(tried)} workers" if len(tried) > 1 else "no other healthy worker to try"))
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no healthy worker among {len(self._upstreams.members)}")


def _cut_off(sent: int) -> str:
    return f"the output was cut off after {sent} message{'' if sent == 1 else 's'}"
