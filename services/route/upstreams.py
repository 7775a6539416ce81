"""The workers behind the router: who they are (a fixed list, or the DNS records of a headless
Service), whether each is healthy (grpc.health.v1, as the workers serve it), and how many calls
this router has open to each.

A health check that gets no answer (the worker is frozen, dead or cut off) also cuts the calls in
flight to that worker that have heard nothing from it since the check was sent (``Attempt``): they
are retried elsewhere or end with a status naming the worker, instead of waiting for their
deadline. An answer of NOT_SERVING cuts nothing: that worker is draining (SIGTERM), and its streams
finish there. Neither does leaving the DNS answer: a retired worker's calls drain on its channel.

Everything here runs on the router's event loop, so the counters need no lock.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvshare.v1 import generator_pb2 as pb
from services.route.attempt import Attempt

log = logging.getLogger(__name__)

GENERATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name

_CHANNEL_OPTIONS = (
    # The worker bounds what it sends (its --max-message-bytes); the router passes it on.
    ("grpc.max_receive_message_length", -1),
    # gRPC backs off up to 120 s between reconnects by default: a worker restarted on the same
    # address would then stay unusable long after its health service says SERVING again.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 5000),
    # A stream's HTTP/2 window stays at its initial 64 KiB (as on the HTTP face's channel): with
    # bandwidth-delay probing it grows to megabytes, so a caller that stops reading would leave the
    # worker's answer piling up in this router while its row runs on, never paused by the worker's
    # bound on unread tokens (nor ended after its --max-paused-s).
    ("grpc.http2.bdp_probe", 0),
)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (what gRPC targets expect)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class StaticWorkers:
    """A fixed set of worker addresses (``--workers``); gRPC resolves a host name in one itself."""

    addresses: tuple[str, ...]
    interval_s: None = None
    """Never looked up again."""

    async def resolve(self) -> list[str]:
        return list(self.addresses)


@dataclass(frozen=True, slots=True)
class DnsWorkers:
    """Every A and AAAA record of ``name`` is a worker on ``port`` (``--workers-dns``): a headless
    Kubernetes Service lists its ready pods that way, so pods that come, go or stop being ready are
    seen within ``interval_s`` seconds."""

    name: str
    port: int
    interval_s: float

    async def resolve(self) -> list[str]:
        """The records' addresses, sorted; raises OSError (socket.gaierror) when the look-up fails."""
        infos = await asyncio.get_running_loop().getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        return sorted({join_host_port(info[4][0], self.port) for info in infos})


Discovery = StaticWorkers | DnsWorkers


@dataclass(eq=False, slots=True)
class Upstream:
    """One worker as this router sees it. ``healthy``: its last health check said SERVING and no
    call to it has failed UNAVAILABLE since (None until its first check). ``streams``: Generate
    streams this router has open to it, the measure of the load bound (other routers' streams are
    not counted). ``calls``: every call open to it, health checks included; a worker that left
    the set (``retired``) keeps its channel until they end. ``attempts``: the forwarded calls
    among them, which a failed health check may cut."""

    address: str
    channel: grpc.aio.Channel
    healthy: bool | None = None
    streams: int = 0
    calls: int = 0
    retired: bool = False
    attempts: set[Attempt] = field(default_factory=set)


class UpstreamSet:
    """The current workers, kept up to date by a discovery loop (DNS only) and a health loop.

    ``on_serving(bool)`` is awaited whenever the answer to "is at least one worker healthy?"
    changes (and once at start), so the router's own health service can follow it."""

    def __init__(self, discovery: Discovery, health_interval_s: float, health_timeout_s: float,
                 on_serving: Callable[[bool], Awaitable[None]]) -> None:
        self._discovery = discovery
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._on_serving = on_serving
        self._members: dict[str, Upstream] = {}
        self._retiring: set[Upstream] = set()
        self._loops: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()
        self._serving: bool | None = None
        self._resolve_error: str | None = None

    @property
    def members(self) -> list[Upstream]:
        return list(self._members.values())

    def healthy(self) -> list[Upstream]:
        return [u for u in self._members.values() if u.healthy]

    async def start(self) -> None:
        """Discovers and checks the workers once (so the first calls find them), then keeps doing
        so in the background until ``close``."""
        await self._discover()
        self._loops.append(asyncio.ensure_future(self._every(self._health_interval_s, self._check_all)))
        if self._discovery.interval_s is not None:
            self._loops.append(asyncio.ensure_future(self._every(self._discovery.interval_s, self._discover)))

    async def mark_unhealthy(self, upstream: Upstream, why: str) -> None:
        """A call to ``upstream`` failed UNAVAILABLE before it answered: no new calls go there
        until a health check passes again."""
        self._set_health(upstream, False, why)
        await self._publish()

    @contextmanager
    def using(self, upstream: Upstream, stream: bool, attempt: Attempt | None = None) -> Iterator[grpc.aio.Channel]:
        """``upstream``'s channel, counted as one more call (and stream, for a Generate call)
        until the block ends; ``attempt``, a forwarded call, is cut if a health check fails."""
        upstream.calls += 1
        upstream.streams += stream
        if attempt is not None:
            upstream.attempts.add(attempt)
        try:
            yield upstream.channel
        finally:
            upstream.calls -= 1
            upstream.streams -= stream
            upstream.attempts.discard(attempt)
            if upstream.retired and not upstream.calls:
                self._retiring.discard(upstream)
                self._close_soon(upstream)

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, *self._closing, return_exceptions=True)
        await asyncio.gather(*(u.channel.close() for u in [*self._members.values(), *self._retiring]))

    def _close_soon(self, upstream: Upstream) -> None:
        task = asyncio.ensure_future(upstream.channel.close())
        self._closing.add(task)  # a task nobody references can be collected before it ends
        task.add_done_callback(self._closing.discard)

    async def _every(self, interval_s: float, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except Exception:  # noqa: BLE001 - a loop that died would freeze the worker set unnoticed
                log.exception("updating the workers failed; trying again in %.1f s", interval_s)

    async def _discover(self) -> None:
        try:
            addresses = await self._discovery.resolve()
        except OSError as exc:
            # Keep the workers known so far: their health checks still say which are up, and a
            # DNS hiccup must not empty the router.
            error = f"{type(exc).__name__}: {exc}"
            if error != self._resolve_error:
                log.warning("cannot resolve the workers (%s); keeping the %d known", error, len(self._members))
            self._resolve_error = error
            return
        if self._resolve_error is not None:
            log.info("workers resolve again")
            self._resolve_error = None
        gone = [u for address, u in self._members.items() if address not in addresses]
        added = [Upstream(a, grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS))
                 for a in addresses if a not in self._members]
        for upstream in gone:
            self._retire(upstream)
        for upstream in added:
            self._members[upstream.address] = upstream
        if gone or added:
            log.info("workers: %s", ", ".join(self._members) or "none")
        await asyncio.gather(*(self._check(u) for u in added))
        await self._publish()

    def _retire(self, upstream: Upstream) -> None:
        del self._members[upstream.address]
        upstream.retired, upstream.healthy = True, False
        if upstream.calls:
            self._retiring.add(upstream)
        else:
            self._close_soon(upstream)

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.members))
        await self._publish()

    async def _check(self, upstream: Upstream) -> None:
        if upstream.retired:  # its channel may be closed already
            return
        # Counted as a call: a worker retired meanwhile keeps its channel until the check ends
        # (closing it would cancel the check, and the cancellation would end the health loop).
        sent_at = asyncio.get_running_loop().time()
        with self.using(upstream, stream=False) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=GENERATOR_SERVICE), timeout=self._health_timeout_s)
                healthy, answered = reply.status == health_pb2.HealthCheckResponse.SERVING, True
                why = f"health check: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            except grpc.aio.AioRpcError as err:
                healthy, answered = False, False
                why = f"health check: {err.code().name}: {err.details()}"
        if not upstream.retired:
            self._set_health(upstream, healthy, why)
            if not answered:
                self._cut_silent(upstream, sent_at, why.removeprefix("health check: "))

    def _cut_silent(self, upstream: Upstream, since: float, why: str) -> None:
        """Cuts the calls in flight to ``upstream`` that heard nothing from it since ``since``,
        when a health check sent then got no answer."""
        cut = sum(a.cut_if_silent_since(since, why) for a in list(upstream.attempts))
        if cut:
            log.warning("worker %s did not answer its health check (%s): cut %d call(s) in flight to it that it "
                        "had left silent since", upstream.address, why, cut)

    def _set_health(self, upstream: Upstream, healthy: bool, why: str) -> None:
        if healthy and not upstream.healthy:
            log.info("worker %s is healthy", upstream.address)
        elif not healthy and upstream.healthy is not False:
            log.warning("worker %s is unhealthy (%s): its prefixes go to their next-best worker", upstream.address, why)
        upstream.healthy = healthy

    async def _publish(self) -> None:
        serving = any(u.healthy for u in self._members.values())
        if serving != self._serving:
            self._serving = serving
            await self._on_serving(serving)
