"""Router configuration: flags over ``KVSHARE_ROUTE_*`` variables over defaults, the same rules as
the worker's settings (``services/api/config.py``; both in ``services/serving/flags.py``) under a
prefix of its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from services.serving.flags import FlagSettings

ROUTE_ENV_PREFIX = "KVSHARE_ROUTE_"


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6 address]:port`` as (host, port); ValueError says what is wrong."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{address!r}: an IPv6 address goes in brackets, [ADDRESS]:PORT")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class RouteSettings(FlagSettings):
    """Everything ``kvshare route`` can be told. Units are in the names (s, bytes)."""

    env_prefix: ClassVar[str] = ROUTE_ENV_PREFIX

    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on; 0.0.0.0 inside a container."})
    port: int = field(default=50050, metadata={"help": "TCP port; 0 picks a free one (the chosen port is printed)."})
    http_port: int = field(default=0, metadata={"min": 0, "max": 65535, "help": "Port (on --host) of the OpenAI-compatible HTTP API, routed to the workers by the same prompt prefixes as gRPC calls: /v1/chat/completions, /v1/completions, /v1/audio/transcriptions, /v1/models, /health; 0 = none."})
    http_timeout_s: float = field(default=0.0, metadata={"min": 0.0, "max": 86400.0, "help": "Deadline of one HTTP API request, its whole stream included; past it the answer is 504 (or a stream ends with an error event). 0 = none."})
    http_max_connections: int = field(default=512, metadata={"min": 1, "max": 1_000_000, "help": "Open connections of the HTTP API; at the limit a new connection takes the place of the one idle longest (no request begun), which is closed; with none idle it is answered 503 (with Retry-After) and closed at once, never queued. 512: room for the streams of a few workers at their defaults, with idle keep-alive connections, within the usual soft limit of 1,024 open files (a router in front of many workers may need more, and a higher file limit); besides its body (--http-max-buffered-bytes) each may hold up to about 0.4 MiB that aiohttp reads ahead."})
    http_max_buffered_bytes: int = field(default=64 * 1024 * 1024, metadata={"min": 1, "help": "Bytes of HTTP request bodies held at once, all requests together, decoded (a compressed body counts what it decodes to; an upload counts its Content-Length, or its whole bound when chunked or compressed); past it a request gets 503 with Retry-After, and a body larger than this alone gets 413. 64 MiB: sixteen of the largest JSON bodies (4 MiB), or two of the largest uploads by default, at once."})
    http_header_timeout_s: float = field(default=10.0, metadata={"min": 0.001, "max": 3600.0, "help": "Seconds from a request's first byte (or a TLS connection's opening) to its complete head, request line and headers; past it the connection is closed. A connection that begins no request is closed after 75 s idle."})
    http_body_timeout_s: float = field(default=60.0, metadata={"min": 0.001, "max": 86400.0, "help": "Seconds a request's body may take to arrive once its head has; past it the answer is 408."})
    workers: str = field(default="", metadata={"help": "Workers as HOST:PORT,HOST:PORT (a fixed set); or use --workers-dns."})
    workers_dns: str = field(default="", metadata={"help": "NAME:PORT of a headless Kubernetes Service: every A/AAAA record of NAME is a worker, re-resolved every --discovery-interval-s."})
    discovery_interval_s: float = field(default=5.0, metadata={"min": 0.1, "help": "Seconds between DNS look-ups of --workers-dns."})
    health_interval_s: float = field(default=2.0, metadata={"min": 0.05, "help": "Seconds between grpc.health.v1 checks of each worker; one that is not SERVING gets no new calls until it is again. A check that gets no answer (a frozen or dead worker) also cuts that worker's calls in flight that it has left silent since the check was sent: retried on the next-best worker if nothing reached the caller yet, else ended UNAVAILABLE naming the worker; NOT_SERVING (a draining worker) cuts nothing."})
    health_timeout_s: float = field(default=1.0, metadata={"min": 0.01, "help": "Deadline of one health check; past it the worker counts as unhealthy, and its calls in flight that it left silent meanwhile are cut."})
    first_response_timeout_s: float = field(default=300.0, metadata={"min": 0.0, "max": 86400.0, "help": "Seconds a worker may take to send a call's first response message (a Generate stream's first tokens, after its queue wait and prefill; a Tokenize or GetModelInfo answer); past it the router cancels the call there and tries it once on the next-best worker, or ends it UNAVAILABLE naming the worker. Generous, since a long prompt behind a full queue on a CPU worker takes minutes; a frozen or dead worker is found sooner by its failing health checks. 0 = no bound."})
    stream_idle_timeout_s: float = field(default=60.0, metadata={"min": 0.0, "max": 86400.0, "help": "Seconds a worker may go without a message in a Generate stream that has begun (time the caller takes to read does not count); past it the stream ends UNAVAILABLE naming the worker and how many messages the caller got. A running stream hears from its worker every decode step (with the worker's --stream-interval, every N steps, at most a quarter second apart while it decodes). 0 = no bound."})
    route_prefix_bytes: int = field(default=256, metadata={"min": 1, "help": "Leading UTF-8 bytes of a prompt (or of its messages' roles and contents) that choose its worker: requests that agree on them go to the same worker."})
    max_streams_per_worker: int = field(default=0, metadata={"min": 0, "help": "Generate streams this router keeps open to one worker before sending a prefix to its next-best worker (the least loaded when all are at the bound); 0 = no bound."})
    max_message_bytes: int = field(default=32 * 1024 * 1024, metadata={"min": 1, "help": "Largest request message; larger ones are refused with RESOURCE_EXHAUSTED. Keep it equal to the workers' --max-message-bytes (32 MiB by default: room for a request's audio)."})
    not_serving_s: float = field(default=2.0, metadata={"min": 0.0, "max": 3600.0, "help": "On SIGTERM, seconds to keep forwarding calls while health reports NOT_SERVING, so balancers stop sending here first."})
    drain_s: float = field(default=20.0, metadata={"min": 0.0, "max": 86400.0, "help": "On SIGTERM, seconds in-flight streams get to finish before the router stops."})
    log_level: str = field(default="INFO", metadata={"help": "Python logging level."})
    log_format: str = field(default="text", metadata={"help": "Log lines as text, or json (one object per line, for log shippers).", "choices": ["text", "json"]})

    def problems(self) -> list[str]:
        """Out-of-range numbers (as for the worker), and a worker set that is not exactly one of
        --workers and --workers-dns, or holds an address that is not HOST:PORT."""
        # FlagSettings.problems by name: zero-argument super() fails in a slots dataclass.
        found = FlagSettings.problems(self)
        if bool(self.workers.strip()) == bool(self.workers_dns.strip()):
            found.append(f"give the workers with exactly one of --workers HOST:PORT,... (env {ROUTE_ENV_PREFIX}WORKERS) "
                         f"and --workers-dns NAME:PORT (env {ROUTE_ENV_PREFIX}WORKERS_DNS)")
            return found
        for address in self.static_workers() or [self.workers_dns]:
            try:
                split_host_port(address)
            except ValueError as exc:
                found.append(f"--workers{'-dns' if self.workers_dns else ''}: {exc}")
        return found

    def static_workers(self) -> list[str]:
        """The addresses of --workers, in order, without duplicates (empty with --workers-dns)."""
        return list(dict.fromkeys(a.strip() for a in self.workers.split(",") if a.strip()))
