"""Starts `kvshare serve` as a child process and waits until it is healthy.

Used by the demo, the benchmarks and the tests, so each of them runs the real server binary
path the way a user does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_LISTENING = "kvshare listening on "


class WorkerProcess:
    """A running `kvshare serve`; ``target`` is its host:port. Always call ``stop()`` (or use ``with``)."""

    def __init__(self, model: Path, *extra_args: str, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 60.0, log_path: Path | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        """``credentials``: how to reach a worker serving TLS (for the health check; None: plaintext)."""
        self.credentials = credentials
        command = [sys.executable, "-m", "services.api.cli", "serve", "--model", str(model), "--port", "0", *extra_args]
        self.log_lines: list[str] = []
        self._log_file = log_path.open("w") if log_path else None
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, cwd=Path(__file__).resolve().parents[2],
        )
        self._port_ready = threading.Event()
        self.target = ""
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        try:
            self._wait_healthy(startup_timeout_s)
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

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._port_ready.wait(0.05):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._reader.join(1)
                raise RuntimeError("kvshare serve did not start:\n" + "\n".join(self.log_lines[-40:]))
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
                    raise RuntimeError("kvshare serve never became healthy:\n" + "\n".join(self.log_lines[-40:]))
                time.sleep(0.05)

    def channel(self) -> grpc.Channel:
        """A channel to the worker, over TLS when it was started with ``credentials``."""
        if self.credentials is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, self.credentials)

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

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
