"""The HTTP face of a gRPC server in this process (``kvshare serve`` or ``kvshare route``): the
server also listens on a Unix socket in a directory only this user can enter, and the face calls
it there, so that it reaches the server whatever ``--host`` is and whatever TLS the TCP port
speaks, and no other user of the machine can use the socket to skip that TLS."""

from __future__ import annotations

import shutil
import ssl
import tempfile
from pathlib import Path

import grpc

from services.http.app import HttpFace
from services.http.limits import HttpLimits
from services.http.upstream import Upstream
from services.serving.port_probe import PortUse


class LocalFront:
    """Made before ``server.start()`` (it adds the socket's port); ``start`` once it serves."""

    def __init__(self, server: grpc.aio.Server, limits: HttpLimits) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kvshare-http-"))  # mode 0700
        target = f"unix:{self._dir / 'grpc.sock'}"
        server.add_insecure_port(target)
        self.face = HttpFace(Upstream(target, limits.max_body_bytes), limits)

    async def start(self, host: str, use: PortUse, tls: ssl.SSLContext | None) -> int:
        """Serves on ``use``'s port of ``host``; the port bound."""
        try:
            return await self.face.start(host, use.port, tls)
        except OSError as exc:
            await self.stop()
            raise use.taken(host, exc.strerror or str(exc)) from exc

    async def stop(self) -> None:
        await self.face.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
