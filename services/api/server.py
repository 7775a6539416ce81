"""Runs the gRPC server: Generator, grpc.health.v1 health, server reflection, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cachestore.breaker import BreakerPolicy
from cachestore.factory import RedisTLS, StoreOptions, open_store, url_holds_password
from cachestore.lease_terms import LeaseTerms
from cachestore.secret_files import load_secret
from cachestore.signing import Keyring
from cachestore.stats import CacheStats
from services.api.api_keys import ApiKeys
from services.api.config import Settings
from services.api.late_servicer import LOADING, LateServicer
from services.api.message_intake import MessageIntake, receiving_places, receiving_tickets
from services.api.method_handlers import add_generator_to_server, add_health_to_server
from services.api.metrics import WorkerMetrics, serve_metrics
from services.api.servicer import SERVICE_NAME, GeneratorServicer
from services.engine.engine import Engine, EngineOptions
from services.engine.kv_connector.fetch_policy import PrefixFetch
from services.engine.model_front import ModelFront
from services.engine.run_waits import LeaseOptions
from services.engine.scheduler import SchedulerOptions
from services.errors import StartupError, WorkerDied
from services.runtime.device_arrays import open_device
from services.runtime.device_choice import DeviceChoice
from services.serving.announce import announce
from services.serving.graceful import serve_until_signalled
from services.serving.port_probe import PortUse, check_free, listen
from services.serving.readiness import Readiness, watch_reachable

log = logging.getLogger(__name__)


PASSWORD_ENV = "KVSHARE_CACHE_PASSWORD"
STREAM_WINDOW_BYTES = 256 * 1024
"""The HTTP/2 window of each call to the API port: what a client may send it before it reads."""
HEALTH_REQUEST_BYTES = 4096
"""The longest request the --health-port server reads: a HealthCheckRequest names a service."""
# --cache-required pings the store every --breaker-backoff-ms, but never more often than this: a
# backoff of 0 would otherwise ping without pause.
MIN_STORE_PING_MS = 100.0


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise StartupError(f"cannot read the {what} {path}: {exc.strerror}") from exc


def cache_password(settings: Settings, environ: dict[str, str] | None = None) -> str:
    """The Redis AUTH password: from --cache-password-file, else KVSHARE_CACHE_PASSWORD, else ""."""
    if settings.cache_password_file is not None:
        return _read_file(settings.cache_password_file, "Redis password file").decode(errors="replace").strip()
    return (os.environ if environ is None else environ).get(PASSWORD_ENV, "")


def store_options(settings: Settings) -> StoreOptions:
    """Raises SecretFileError for an unusable signing key file."""
    keyring = Keyring.load(settings.cache_signing_key_file) if settings.cache_signing_key_file else None
    return StoreOptions(
        ttl_s=settings.cache_ttl_s,
        op_timeout_ms=settings.cache_op_timeout_ms,
        connect_timeout_ms=settings.cache_connect_timeout_ms,
        max_connections=settings.cache_max_connections,
        memory_max_bytes=settings.cache_memory_bytes,
        l1_max_bytes=settings.cache_l1_bytes,
        breaker=BreakerPolicy(settings.breaker_failures, settings.breaker_backoff_ms, settings.breaker_max_backoff_ms),
        tls=RedisTLS(settings.cache_tls_ca_file, settings.cache_tls_cert_file, settings.cache_tls_key_file),
        username=settings.cache_username,
        password=cache_password(settings),
        keyring=keyring,
        lease_terms=LeaseTerms(settings.lease_max_ttl_ms, settings.lease_clock_skew_ms),
        max_value_bytes=settings.cache_max_value_bytes,
    )


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port (None: plaintext), mutual when a client CA is given."""
    if settings.tls_cert_file is None and settings.tls_key_file is None:
        if settings.tls_client_ca_file is not None:
            raise StartupError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file: client certificates "
                               "are only checked over TLS")
        return None
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        raise StartupError("gRPC TLS needs both --tls-cert-file and --tls-key-file")
    try:
        # gRPC's own check of the pair surfaces later as "cannot listen"; Python's ssl says what is wrong.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"--tls-cert-file {settings.tls_cert_file} and --tls-key-file {settings.tls_key_file} "
                           f"are not a usable PEM certificate chain and its private key ({exc})") from exc
    ca = _read_file(settings.tls_client_ca_file, "client CA file") if settings.tls_client_ca_file else None
    if ca is not None:
        try:
            ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
        except (ValueError, ssl.SSLError) as exc:
            raise StartupError(f"--tls-client-ca-file {settings.tls_client_ca_file} holds no usable PEM "
                               f"certificate ({exc})") from exc
    return grpc.ssl_server_credentials(
        [(_read_file(settings.tls_key_file, "TLS key file"), _read_file(settings.tls_cert_file, "TLS certificate file"))],
        root_certificates=ca, require_client_auth=ca is not None,
    )


def check_store(store, password_given: bool) -> None:
    """Pings the store once at start. Unreachable: a warning, and the worker serves (computing every
    prompt until it answers). Refused credentials or a TLS handshake that fails: a StartupError, since
    waiting will not fix a wrong password or CA."""
    try:
        store.ping()
        log.info("cache store: %s", store.name)
    except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same news to an operator
        kind = store.error_kind(exc)
        if kind == "auth" and not password_given:
            raise StartupError(f"cache store {store.name} requires a password and none was given: set "
                               f"--cache-password-file or {PASSWORD_ENV} (and --cache-username for an ACL user)") from exc
        if kind == "auth":
            raise StartupError(f"cache store {store.name} refused the credentials ({exc}): check "
                               f"--cache-username and --cache-password-file (or {PASSWORD_ENV})") from exc
        if kind == "tls":
            raise StartupError(f"cache store {store.name}: TLS handshake failed ({exc}): check the rediss:// "
                               "host name, --cache-tls-ca-file and the client certificate") from exc
        log.warning("cache store %s is unreachable at start-up (%s: %s); serving anyway, computing every "
                    "prompt until it answers", store.name, type(exc).__name__, exc)


def engine_options(settings: Settings) -> EngineOptions:
    """Raises SecretFileError for an unusable namespace secret file."""
    secret = (load_secret(settings.cache_namespace_secret_file, "namespace secret")
              if settings.cache_namespace_secret_file else b"")
    return EngineOptions(
        max_new_tokens_cap=settings.max_new_tokens_cap, block_size=settings.block_size, cache_dtype=settings.cache_dtype,
        scheduler=SchedulerOptions(settings.max_batch, settings.max_queued, settings.max_prefill_tokens_per_step,
                                   settings.max_unread_tokens, settings.max_paused_s, settings.max_unread_bytes,
                                   settings.max_client_rows, settings.yield_paused_s, settings.stream_interval),
        kv_cache_bytes=settings.kv_cache_bytes,
        store_read_threads=settings.store_read_threads, store_write_threads=settings.store_write_threads,
        max_value_bytes=settings.cache_max_value_bytes,
        namespace_secret=secret,
        max_prompt_bytes=settings.max_prompt_bytes, max_stop_strings=settings.max_stop_strings,
        max_stop_string_bytes=settings.max_stop_string_bytes, max_answer_bytes=settings.max_message_bytes,
        tokenizer_threads=settings.tokenizer_threads,
        audio_threads=settings.audio_threads, max_audio_requests=settings.max_audio_requests,
        max_tokenize_requests=settings.max_tokenize_requests,
        leases=LeaseOptions(settings.lease_wait_factor, settings.lease_poll_ms, max_ttl_ms=settings.lease_max_ttl_ms),
        prefix_fetch=PrefixFetch(settings.prefix_fetch), window_fetch=settings.window_fetch,
    )


def load_engine(settings: Settings, front: ModelFront | None = None, options: EngineOptions | None = None) -> Engine:
    """Raises SecretFileError for an unusable key or secret file, before anything is opened.
    ``front`` and ``options``: the model folder's and ``engine_options(settings)``, when they were
    made already."""
    options = options or engine_options(settings)
    # The device first: a CUDA device that cannot be used stops the worker before it connects anywhere.
    device = open_device(DeviceChoice.parse(settings.device))
    stats = CacheStats()
    opened_with = store_options(settings)
    store = open_store(settings.cache_url, opened_with, stats)
    try:
        check_store(store, bool(opened_with.password) or url_holds_password(settings.cache_url))
    except StartupError:
        store.close()
        raise
    engine = Engine.load(settings.model, options, store, stats, device, settings.intra_op_threads,
                         settings.intra_op_spinning, front)
    engine.warm_up(settings.prefault_tokens, settings.store_read_threads + settings.store_write_threads + 1)
    return engine


def _health_server(health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """A server holding only the health service: the plaintext port that Kubernetes' gRPC probes
    (which speak no TLS) can reach while the API port speaks TLS. It says SERVING or NOT_SERVING and
    nothing else, the same answers as the API port's own health service."""
    # A few streams per connection: enough for Check and a Watch or two, never a pile of Watches;
    # and no request longer than a service's name needs (gRPC's default would hold 4 MiB per call).
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 8),
                                      ("grpc.max_receive_message_length", HEALTH_REQUEST_BYTES)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


async def _stop_listening(server: grpc.aio.Server, health_server: grpc.aio.Server | None, front) -> None:
    """Closes the ports of a worker whose model did not load."""
    if front is not None:
        await front.stop()
    if health_server is not None:
        await health_server.stop(None)
    await server.stop(None)


async def serve(settings: Settings) -> None:
    """Probes its ports (a port in use is refused at once), reads the model's spec and tokenizer
    (its largest valid request is the server's receive bound), binds its ports, then loads the
    sessions (meanwhile health reports NOT_SERVING and calls get UNAVAILABLE); serves until
    SIGTERM or SIGINT; then reports NOT_SERVING for ``not_serving_s`` seconds while still accepting
    calls, ends the calls whose message has not come, and stops, giving in-flight streams
    ``drain_s`` seconds to finish."""
    credentials = server_credentials(settings)
    keys = ApiKeys.load(settings.api_keys_file) if settings.api_keys_file else None
    api_port = PortUse(settings.port, "--port", "cannot listen on", zero_picks_free=True)
    health_port = PortUse(settings.health_port, "--health-port", "cannot listen on")
    metrics_port = PortUse(settings.metrics_port, "--metrics-port", "cannot serve metrics on")
    http_port = PortUse(settings.http_port, "--http-port", "cannot serve HTTP on")
    check_free(settings.host, (api_port, health_port, http_port, metrics_port))
    # Before the server is built: its receive bound is the largest valid request of this model.
    options = engine_options(settings)
    model_front = await asyncio.to_thread(ModelFront.read, settings.model, options)
    largest = model_front.limits.message_bytes
    message_bytes = min(settings.max_message_bytes, largest or settings.max_message_bytes)
    log.info("request messages up to %d bytes are read (%s), %d at a time (--max-receiving-bytes %d)", message_bytes,
             "the largest valid request of this model" if message_bytes < settings.max_message_bytes
             else "--max-message-bytes", receiving_places(settings.max_receiving_bytes, message_bytes),
             settings.max_receiving_bytes)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            # gRPC sets SO_REUSEPORT by default: a second worker on a taken port would start and
            # silently split the calls with the first. Refuse the port instead.
            ("grpc.so_reuseport", 0),
            # What a client may send this server unread: a fixed 256 KiB window per stream, BDP
            # probing off. With probing (gRPC's default) windows grew to 4 MiB, so each refused or
            # trickled body put up to 4 MiB in memory (40 refused 22 MiB bodies: +114 MiB kept;
            # now +2 MiB); uploads on loopback were no slower (docs/reliability.md).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ],
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs or None,
    )
    generator = LateServicer()
    intake = MessageIntake(settings.request_read_timeout_s,
                           receiving_tickets(settings.max_receiving_bytes, message_bytes))
    add_generator_to_server(generator, server, intake)
    health_servicer = health.aio.HealthServicer()
    add_health_to_server(health_servicer, server, intake)
    readiness = Readiness(health_servicer, SERVICE_NAME)
    await readiness.hold(LOADING, server_wide=True)
    if settings.reflection:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
        )
    health_server = _health_server(health_servicer) if settings.health_port else None
    if settings.http_port:
        # Imported only here: aiohttp and the HTTP face are a quarter of a worker's start-up imports
        # (about 0.45 of 2 CPU-seconds), and most workers serve gRPC alone.
        from services.http.app import tls_context
        from services.http.limits import HttpLimits
        from services.http.local_front import LocalFront

        front = LocalFront(server, HttpLimits.of(settings))
    else:
        front = None
    port = listen(server, settings.host, api_port, credentials)
    if health_server is not None:
        listen(health_server, settings.host, health_port)
    registry = None
    if settings.metrics_port:
        try:
            registry = serve_metrics(settings.host, settings.metrics_port)
        except OSError as exc:
            raise metrics_port.taken(settings.host, exc.strerror or str(exc)) from exc
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    await server.start()
    if health_server is not None:
        await health_server.start()
        log.info("health (grpc.health.v1 only, plaintext) on %s:%d", settings.host, settings.health_port)
    if front is not None:
        tls = None if credentials is None else tls_context(settings.tls_cert_file, settings.tls_key_file,
                                                           settings.tls_client_ca_file)
        try:
            bound_http_port = await front.start(settings.host, http_port, tls)
        except StartupError:
            await _stop_listening(server, health_server, None)  # a front that did not start stopped itself
            raise
    try:
        # On a thread: the event loop answers health checks and calls meanwhile.
        engine = await asyncio.to_thread(load_engine, settings, model_front, options)
    except BaseException:
        await _stop_listening(server, health_server, front)
        raise
    generator.ready(GeneratorServicer(engine, keys))
    if registry is not None:
        WorkerMetrics(engine, registry)
    store_watch = None
    if settings.cache_required:
        store_watch = await watch_reachable(
            engine.store.ping, readiness, f"cache store {engine.store.name} does not answer",
            max(settings.breaker_backoff_ms, MIN_STORE_PING_MS) / 1e3, settings.breaker_failures)
    await readiness.release(LOADING)
    if front is not None:
        # Tests and scripts read this line to learn the HTTP port.
        announce(f"kvshare http listening on {settings.host}:{bound_http_port}")
    # Tests and scripts read this line to learn the port when --port 0 was given (and that the
    # model has loaded: the port is bound, and answers, from before).
    announce(f"kvshare listening on {settings.host}:{port}")
    log.info("serving %s (%s, %s) on %s:%d (%s%s)", engine.spec.name, engine.session.device_name,
             engine.session.execution_provider, settings.host, port,
             "plaintext" if credentials is None else "TLS" if settings.tls_client_ca_file is None else "mutual TLS",
             ", API keys required" if keys else "")

    died = asyncio.Event()
    loop = asyncio.get_running_loop()
    engine.scheduler.on_death.append(lambda _: loop.call_soon_threadsafe(died.set))
    if engine.scheduler.died is not None:
        died.set()
    fatal = await serve_until_signalled(server, health_servicer, settings.not_serving_s, settings.drain_s, died,
                                        intake.drain, engine.end_streams)
    if store_watch is not None:
        store_watch.cancel()
    if front is not None:
        await front.stop()
    if health_server is not None:
        await health_server.stop(None)
    await engine.wait_for_publishes()
    engine.close()
    if fatal:
        raise WorkerDied(f"the scheduler stopped ({type(engine.scheduler.died).__name__}: {engine.scheduler.died}); "
                         "exiting for a restart")
    log.info("stopped")
