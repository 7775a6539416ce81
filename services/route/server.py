"""Runs the router: the forwarding Generator, grpc.health.v1 health, server reflection, SIGTERM.

Its health service says SERVING while at least one worker is healthy, so a balancer or kubelet in
front of routers stops sending to a router that could only answer UNAVAILABLE.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.errors import StartupError
from services.http.limits import HttpLimits
from services.http.local_front import LocalFront
from services.route.attempt import Limits
from services.route.config import RouteSettings, split_host_port
from services.route.proxy import Proxy
from services.route.upstreams import (
    GENERATOR_SERVICE,
    Discovery,
    DnsWorkers,
    StaticWorkers,
    UpstreamSet,
)
from services.serving.announce import announce
from services.serving.graceful import serve_until_signalled
from services.serving.port_probe import PortUse, listen

log = logging.getLogger(__name__)


def discovery(settings: RouteSettings) -> Discovery:
    """The worker set the settings name (already checked by ``RouteSettings.problems``)."""
    if settings.workers_dns:
        name, port = split_host_port(settings.workers_dns)
        return DnsWorkers(name, port, settings.discovery_interval_s)
    return StaticWorkers(tuple(settings.static_workers()))


async def serve(settings: RouteSettings) -> None:
    """Serves until SIGTERM or SIGINT; then reports NOT_SERVING for ``not_serving_s`` seconds while
    still forwarding calls, and stops, giving in-flight streams ``drain_s`` seconds to finish."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        # What the workers send is bounded by their own --max-message-bytes.
        ("grpc.max_send_message_length", -1),
        # As for `kvshare serve`: a second router on a taken port must fail, not share the port.
        ("grpc.so_reuseport", 0),
    ])
    health_servicer = health.aio.HealthServicer()

    async def on_serving(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GENERATOR_SERVICE):
            await health_servicer.set(service, status)
        if not serving:
            log.warning("no healthy worker: calls are answered UNAVAILABLE until one is")

    upstreams = UpstreamSet(discovery(settings), settings.health_interval_s, settings.health_timeout_s, on_serving)
    limits = Limits(settings.first_response_timeout_s, settings.stream_idle_timeout_s)
    handlers = Proxy(upstreams, settings.route_prefix_bytes, settings.max_streams_per_worker, limits).method_handlers()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATOR_SERVICE, handlers),))
    server.add_registered_method_handlers(GENERATOR_SERVICE, handlers)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATOR_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = listen(server, settings.host, PortUse(settings.port, "--port", "cannot listen on", zero_picks_free=True))
    front = LocalFront(server, HttpLimits.of(settings)) if settings.http_port else None
    await upstreams.start()
    await server.start()
    # Tests and scripts read this line to learn the port when --port 0 was given.
    announce(f"kvshare listening on {settings.host}:{port}")
    if front is not None:
        try:
            http_use = PortUse(settings.http_port, "--http-port", "cannot serve HTTP on")
            http_port = await front.start(settings.host, http_use, None)
        except StartupError:
            await server.stop(None)
            await upstreams.close()
            raise
        announce(f"kvshare http listening on {settings.host}:{http_port}")
    log.info("routing on %s:%d to %d worker(s) (%d healthy), by the first %d bytes of each prompt%s",
             settings.host, port, len(upstreams.members), len(upstreams.healthy()), settings.route_prefix_bytes,
             f", at most {settings.max_streams_per_worker} streams per worker" if settings.max_streams_per_worker else "")

    await serve_until_signalled(server, health_servicer, settings.not_serving_s, settings.drain_s)
    if front is not None:
        await front.stop()
    await upstreams.close()
    log.info("stopped")
