"""The ports a server will serve: whether they are free, asked before a worker reads anything of
its model, so that a port in use is refused at once (its servers are built only once the model's
request limits are known, ``services.engine.model_front``, which takes seconds for a large
vocabulary), and the one message a taken port gets, whoever finds it taken. Another process may
still take a port in the moments between the question and the bind; the bind then says so."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from services.errors import StartupError


@dataclass(frozen=True, slots=True)
class PortUse:
    port: int
    """0: none, or one the server picks: nothing to ask."""
    flag: str
    refusal: str
    """What the server cannot do on a taken port ("cannot listen on")."""
    zero_picks_free: bool = False
    """0 asks for a free port (else it means none): the refusal says so."""

    def taken(self, host: str, reason: str) -> StartupError:
        hint = " (0 picks a free one)" if self.zero_picks_free else ""
        return StartupError(f"{self.refusal} {host}:{self.port}: {reason}; pick another {self.flag}{hint}")


def check_free(host: str, uses: Iterable[PortUse]) -> None:
    """Raises ``PortUse.taken`` for the first port of ``uses`` that cannot be bound on ``host`` (as
    the servers bind: SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    for use in uses:
        if not use.port:
            continue
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), use.port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            raise use.taken(host, exc.strerror or str(exc)) from exc


def listen(server: grpc.aio.Server, host: str, use: PortUse, credentials: grpc.ServerCredentials | None = None) -> int:
    """Adds ``use``'s port on ``host`` to ``server`` (TLS with ``credentials``); the port bound."""
    address = f"{host}:{use.port}"
    try:
        return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:  # gRPC's only signal that the bind failed
        raise use.taken(host, "the address is in use or not available here") from exc
