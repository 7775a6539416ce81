"""A loopback TCP proxy that can cut its connections in the middle of a reply, for fault tests:
what a worker does when the network drops a Redis connection while a multi-megabyte MGET streams."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from services.local.redis_process import free_port


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``upstream_port``. Inside ``with proxy.cutting(n):`` every
    connection is closed in both directions as soon as its upstream side has sent ``n`` bytes
    (counted per connection from the block's start): a reply of ``n`` bytes or more is cut in its
    middle, the client's retry of it too. ``cuts`` counts the cuts made."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.cuts = 0
        self._cut_bytes: int | None = None
        self._epoch = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @contextmanager
    def cutting(self, n_bytes: int) -> Iterator[None]:
        with self._lock:
            self._cut_bytes, self._epoch = n_bytes, self._epoch + 1
        try:
            yield
        finally:
            with self._lock:
                self._cut_bytes = None

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, pair, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, pair, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, pair: tuple[socket.socket, socket.socket],
              downstream: bool) -> None:
        epoch, sent = -1, 0
        try:
            while data := source.recv(65536):
                cut = False
                if downstream:
                    with self._lock:
                        if self._cut_bytes is not None:
                            if epoch != self._epoch:
                                epoch, sent = self._epoch, 0
                            if sent + len(data) >= self._cut_bytes:
                                data, cut = data[: self._cut_bytes - sent], True
                                self.cuts += 1
                            sent += len(data)
                sink.sendall(data)
                if cut:
                    break
        except OSError:
            pass
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
