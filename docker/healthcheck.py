"""Container health check: asks the local worker's grpc.health.v1 service whether it is SERVING.

Exit status 0 when it is, 1 otherwise (not listening, NOT_SERVING while draining, or no answer in
time), as Docker's HEALTHCHECK and compose's healthcheck expect. The port is KVSHARE_HEALTH_PORT
when the worker has one (its plaintext health-only port beside a TLS API port), else KVSHARE_PORT
(default 50051), and the service checked is kvshare.v1.Generator, so a worker that is shutting down
reports unhealthy. Kubernetes does not use this: it has native gRPC probes.

Usage: python healthcheck.py [HOST:PORT] [SERVICE]
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_SERVICE = "kvshare.v1.Generator"
TIMEOUT_S = 3.0


def check(target: str, service: str, timeout_s: float = TIMEOUT_S) -> bool:
    """True when ``target`` answers SERVING for ``service`` within ``timeout_s`` seconds."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            print(f"{target} {service!r}: {exc.code().name}", file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target} {service!r}: {status}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    health_port = os.environ.get("KVSHARE_HEALTH_PORT", "0").strip()
    port = health_port if health_port not in ("", "0") else os.environ.get("KVSHARE_PORT", "50051")
    target = argv[1] if len(argv) > 1 else f"127.0.0.1:{port}"
    service = argv[2] if len(argv) > 2 else DEFAULT_SERVICE
    return 0 if check(target, service) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
