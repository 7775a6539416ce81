"""What the HTTP face may be made to hold and for how long: the settings it is started with, from
the worker's or the router's flags (both name them alike: ``--http-max-connections``...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

IDLE_S = 75.0
"""An open connection that sends no request for this long (since it opened, or since its previous
answer) is closed. Longer than the 60-s idle timeout of common load balancers (AWS ALB,
ingress-nginx's upstream keep-alive), so that they, not this server, close an idle connection:
one closed here while a balancer sends a request on it fails that request."""


class _Flags(Protocol):
    http_timeout_s: float
    max_message_bytes: int
    http_max_connections: int
    http_max_buffered_bytes: int
    http_header_timeout_s: float
    http_body_timeout_s: float


@dataclass(frozen=True, slots=True)
class HttpLimits:
    timeout_s: float
    """Each request's deadline, its stream included (s; 0: none)."""
    max_body_bytes: int
    """The largest upload (bytes; JSON bodies have their own, smaller bound)."""
    max_connections: int
    """Open connections; one more is answered 503 and closed at once."""
    max_buffered_bytes: int
    """Bytes of request bodies held by all requests in flight together; past it, 503."""
    header_timeout_s: float
    """From a request's first byte (or a TLS connection's opening) to its complete head (s)."""
    body_timeout_s: float
    """From a request's complete head to the end of its body (s; 408 past it)."""

    @classmethod
    def of(cls, flags: _Flags) -> HttpLimits:
        """The limits a worker's or a router's settings give."""
        return cls(flags.http_timeout_s, flags.max_message_bytes, flags.http_max_connections,
                   flags.http_max_buffered_bytes, flags.http_header_timeout_s, flags.http_body_timeout_s)
