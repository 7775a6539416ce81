"""Starts `kvshare serve` (or `kvshare route`) as a child process and waits until it is healthy.

Used by the demo, the benchmarks and the tests, so each of them runs the real server binary
path the way a user does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_LISTENING = "kvshare listening on "
_HTTP_LISTENING = "kvshare http listening on "


class ServerProcess:
    """A running `kvshare COMMAND ...` that prints ``kvshare listening on HOST:PORT``; ``target`` is
    that host:port, ``log_lines`` its output so far; with ``--http-port``, ``http_target`` the HTTP
    API's host:port. Always call ``stop()`` (or use ``with``)."""

    def __init__(self, arguments: Sequence[str], env: dict[str, str] | None = None, startup_timeout_s: float = 60.0,
                 log_path: Path | None = None, credentials: grpc.ChannelCredentials | None = None,
                 wait_serving: bool = True) -> None:
        """``arguments``: the command and its flags, after ``kvshare``. ``credentials``: how to reach a
        server speaking TLS (for the health check; None: plaintext). ``wait_serving``: wait until the
        health service says SERVING (False: until the port is printed)."""
        self.credentials = credentials
        self.command = arguments[0]
        self.log_lines: list[str] = []
        self._log_file = log_path.open("w") if log_path else None
        self._process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *arguments], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, **(env or {})}, cwd=Path(__file__).resolve().parents[2],
        )
        self._port_ready = threading.Event()
        self._http_ready = threading.Event()
        self.target = self.http_target = ""
        self._wants_http = "--http-port" in arguments
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        try:
            self._wait_started(startup_timeout_s, wait_serving)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    def _read_output(self) -> None:
        for line in self._process.stdout:
            self.log_lines.append(line.rstrip("\n"))
            if self._log_file:
                self._log_file.write(line)
                self._log_file.flush()
            if line.startswith(_LISTENING):
                self.target = line[len(_LISTENING):].strip()
                self._port_ready.set()
            if line.startswith(_HTTP_LISTENING):
                self.http_target = line[len(_HTTP_LISTENING):].strip()
                self._http_ready.set()

    def _wait_started(self, timeout_s: float, wait_serving: bool) -> None:
        deadline = time.monotonic() + timeout_s
        for ready in (self._port_ready, self._http_ready) if self._wants_http else (self._port_ready,):
            while not ready.wait(0.05):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self._reader.join(1)
                    raise RuntimeError(f"kvshare {self.command} did not start:\n" + "\n".join(self.log_lines[-40:]))
        if not wait_serving:
            return
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvshare {self.command} never became healthy:\n" + "\n".join(self.log_lines[-40:]))
                time.sleep(0.05)

    def channel(self) -> grpc.Channel:
        """A channel to the server, over TLS when it was started with ``credentials``."""
        if self.credentials is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, self.credentials)

    def wait(self, timeout_s: float) -> int:
        """Waits for the process to exit by itself (after a signal the caller sent it: a second
        SIGTERM while it is already shutting down could find Python's default handler) and
        returns its exit code; subprocess.TimeoutExpired past ``timeout_s``."""
        self._process.wait(timeout_s)
        return self.stop()

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait, then SIGKILL if needed; returns the exit code."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._reader.join(2)
        if self._log_file:
            self._log_file.close()
        return self._process.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class WorkerProcess(ServerProcess):
    """A running `kvshare serve --model MODEL --port 0 EXTRA_ARGS...` (``wait_serving=False`` for a
    worker that is not to be SERVING: with --cache-required and its store down)."""

    def __init__(self, model: Path, *extra_args: str, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 60.0, log_path: Path | None = None,
                 credentials: grpc.ChannelCredentials | None = None, wait_serving: bool = True) -> None:
        super().__init__(["serve", "--model", str(model), "--port", "0", *extra_args], env, startup_timeout_s,
                         log_path, credentials, wait_serving)


class RouterProcess(ServerProcess):
    """A running `kvshare route --workers WORKERS --port 0 EXTRA_ARGS...` (healthy once at least one
    worker is; ``wait_serving=False`` for a router whose workers are down)."""

    def __init__(self, workers: Sequence[str], *extra_args: str, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 60.0, log_path: Path | None = None, wait_serving: bool = True) -> None:
        super().__init__(["route", "--workers", ",".join(workers), "--port", "0", *extra_args], env,
                         startup_timeout_s, log_path, wait_serving=wait_serving)
