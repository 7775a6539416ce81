"""The end of a gRPC server's life, shared by `kvshare serve` and `kvshare route`: wait for SIGTERM
or SIGINT, report NOT_SERVING while still accepting calls (so balancers stop routing here first),
then stop accepting and give streams in flight time to finish."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health

log = logging.getLogger(__name__)


FINAL_MESSAGE_S = 1.0
"""How long before a drain's end the calls still running are ended, to send their last message."""
FATAL_GRACE_S = 1.0
"""How long a server that can no longer serve gives its calls to receive their statuses (and its
health watchers NOT_SERVING) before it stops."""


async def serve_until_signalled(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                                not_serving_s: float, drain_s: float, fatal: asyncio.Event | None = None,
                                on_drain: Callable[[], int] | None = None,
                                on_drain_end: Callable[[], None] | None = None) -> bool:
    """Returns once ``server`` has stopped: ``not_serving_s`` seconds after the signal, then at most
    ``drain_s`` seconds of draining (as it begins, ``on_drain()`` ends the calls that hold no work
    and returns how many; ``FINAL_MESSAGE_S`` before it ends, ``on_drain_end()`` ends the calls
    still running, so that they send their last message before gRPC cancels what is left); or,
    once ``fatal`` is set, NOT_SERVING at once and stopped ``FATAL_GRACE_S`` later. Returns whether
    ``fatal`` ended it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait())]
    if fatal is not None:
        waits.append(asyncio.ensure_future(fatal.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if fatal is not None and fatal.is_set():
        log.critical("cannot serve any more: NOT_SERVING, stopping in %.1f s", FATAL_GRACE_S)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(FATAL_GRACE_S)
        return True
    log.info("shutting down: NOT_SERVING for %.1f s, then draining for up to %.1f s", not_serving_s, drain_s)
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(not_serving_s)
    if on_drain is not None and (ended := on_drain()):
        log.info("draining: ended %d calls whose request message had not arrived (UNAVAILABLE)", ended)
    stopping = asyncio.ensure_future(server.stop(drain_s))
    if on_drain_end is not None:
        done, _ = await asyncio.wait({stopping}, timeout=max(drain_s / 2, drain_s - FINAL_MESSAGE_S))
        if not done:
            log.info("drain ending: ending the calls still running (a stream that sent tokens ends with "
                     "FINISH_REASON_ABORT)")
            on_drain_end()
    await stopping
    return False
