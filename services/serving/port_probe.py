"""Whether the ports a worker will serve are free, asked before it reads anything of its model, so
that a port in use is refused at once: the servers themselves are built only once the model's
request limits are known (``services.engine.model_front``), which takes seconds for a large
vocabulary. Another process may still take a port in the moments between; binding it then fails
with the same message."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass

from services.errors import StartupError


@dataclass(frozen=True, slots=True)
class PortUse:
    port: int
    """0: none, or one the server picks: nothing to ask."""
    flag: str
    refusal: str
    """What the worker cannot do on a taken port ("cannot listen on")."""


def taken_message(use: PortUse, host: str, reason: str) -> str:
    return f"{use.refusal} {host}:{use.port}: {reason}; pick another {use.flag}"


def check_free(host: str, uses: Iterable[PortUse]) -> None:
    """Raises StartupError naming the first port of ``uses`` that cannot be bound on ``host`` (as
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
            raise StartupError(taken_message(use, host, exc.strerror or str(exc))) from exc
