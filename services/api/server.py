"""Runs the gRPC server: Generator, grpc.health.v1 health, server reflection, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cachestore.breaker import BreakerPolicy
from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from services.api.config import Settings
from services.api.method_handlers import add_generator_to_server
from services.api.metrics import WorkerMetrics
from services.api.servicer import SERVICE_NAME, GeneratorServicer
from services.engine.engine import Engine, EngineOptions
from services.engine.scheduler import SchedulerOptions
from services.errors import StartupError

log = logging.getLogger(__name__)


def store_options(settings: Settings) -> StoreOptions:
    return StoreOptions(
        ttl_s=settings.cache_ttl_s,
        op_timeout_ms=settings.cache_op_timeout_ms,
        connect_timeout_ms=settings.cache_connect_timeout_ms,
        max_connections=settings.cache_max_connections,
        memory_max_bytes=settings.cache_memory_bytes,
        l1_max_bytes=settings.cache_l1_bytes,
        breaker=BreakerPolicy(settings.breaker_failures, settings.breaker_backoff_ms, settings.breaker_max_backoff_ms),
    )


def load_engine(settings: Settings) -> Engine:
    stats = CacheStats()
    store = open_store(settings.cache_url, store_options(settings), stats)
    try:
        store.ping()
        log.info("cache store: %s", store.name)
    except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same news to an operator
        log.warning("cache store %s is unreachable at start-up (%s: %s); serving anyway, computing every "
                    "prompt until it answers", store.name, type(exc).__name__, exc)
    options = EngineOptions(
        max_new_tokens_cap=settings.max_new_tokens_cap, block_size=settings.block_size,
        scheduler=SchedulerOptions(settings.max_batch, settings.max_queued, settings.max_prefill_tokens_per_step,
                                   settings.max_unread_tokens, settings.max_paused_s),
        kv_cache_bytes=settings.kv_cache_bytes,
        store_read_threads=settings.store_read_threads, store_write_threads=settings.store_write_threads,
        max_value_bytes=settings.cache_max_value_bytes,
        max_prompt_bytes=settings.max_prompt_bytes, max_stop_strings=settings.max_stop_strings,
        max_stop_string_bytes=settings.max_stop_string_bytes, tokenizer_threads=settings.tokenizer_threads,
    )
    return Engine.load(settings.model, options, store, stats, settings.execution_provider, settings.intra_op_threads)


async def serve(settings: Settings) -> None:
    """Serves until SIGTERM or SIGINT; then reports NOT_SERVING for ``not_serving_s`` seconds while
    still accepting calls, and stops, giving in-flight streams ``drain_s`` seconds to finish."""
    engine = load_engine(settings)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            # gRPC sets SO_REUSEPORT by default: a second worker on a taken port would start and
            # silently split the calls with the first. Refuse the port instead.
            ("grpc.so_reuseport", 0),
        ]
    )
    add_generator_to_server(GeneratorServicer(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    except RuntimeError as exc:  # gRPC's only signal that the bind failed
        engine.close()
        raise StartupError(f"cannot listen on {settings.host}:{settings.port}: the address is in use or not "
                           "available here; pick another --port (0 picks a free one)") from exc
    if settings.metrics_port:
        try:
            WorkerMetrics(engine).serve(settings.host, settings.metrics_port)
        except OSError as exc:
            engine.close()
            raise StartupError(f"cannot serve metrics on {settings.host}:{settings.metrics_port}: {exc.strerror}") from exc
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    # Tests and scripts read this line to learn the port when --port 0 was given.
    print(f"kvshare listening on {settings.host}:{port}", flush=True)
    log.info("serving %s (%s) on %s:%d", engine.spec.name, engine.session.execution_provider, settings.host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: NOT_SERVING for %.1f s, then draining for up to %.1f s", settings.not_serving_s, settings.drain_s)
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(settings.not_serving_s)
    await server.stop(settings.drain_s)
    await engine.wait_for_publishes()
    engine.close()
    log.info("stopped")
