"""The end of a gRPC server's life, shared by `kvshare serve` and `kvshare route`: wait for SIGTERM
or SIGINT, report NOT_SERVING while still accepting calls (so balancers stop routing here first),
then stop accepting and give streams in flight time to finish."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health

log = logging.getLogger(__name__)


async def serve_until_signalled(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                                not_serving_s: float, drain_s: float) -> None:
    """Returns once ``server`` has stopped: ``not_serving_s`` seconds after the signal, then at most
    ``drain_s`` seconds of draining."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: NOT_SERVING for %.1f s, then draining for up to %.1f s", not_serving_s, drain_s)
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(not_serving_s)
    await server.stop(drain_s)
