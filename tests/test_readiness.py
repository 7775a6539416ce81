"""A worker's ports and health before, during and after its model loads, and under --cache-required.

Real `kvshare serve` processes on loopback, a real redis-server killed and restarted on its port,
and the real grpc.health.v1 service; every wait is for an event (a health Watch message, a FIFO
opened by the loading worker), never for a length of time."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import urlopen

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.local.redis_process import RedisServer, free_port
from services.local.worker_process import WorkerProcess
from services.serving.readiness import Readiness

pytestmark = pytest.mark.subprocess
ROOT = Path(__file__).resolve().parent.parent
GENERATOR = "kvshare.v1.Generator"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
# Bounds on waits for events that come within a second or two; only a broken worker reaches them.
EVENT_TIMEOUT_S = 120


def free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def check(channel: grpc.Channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status


def statuses(channel: grpc.Channel, service: str) -> Iterator[int]:
    """The health Watch of ``service``: its status now, then each change."""
    replies = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=EVENT_TIMEOUT_S)
    return (reply.status for reply in replies)


def until(watch: Iterator[int], status: int) -> None:
    for seen in watch:
        if seen == status:
            return
    raise AssertionError(f"the health Watch ended before {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")


def answers(channel: grpc.Channel) -> None:
    request = pb.GenerateRequest(prompt="The system prompt tells the assistant who it is.", max_new_tokens=3,
                                 ignore_eos=True)
    assert complete(pb_grpc.GeneratorStub(channel), request, timeout_s=60).last.usage.completion_tokens == 3


def http_health(port: int) -> int:
    try:
        with urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as reply:
            return reply.status
    except HTTPError as exc:
        return exc.code


def test_readiness_answers_from_the_reasons_held():
    """A server-wide reason makes both names NOT_SERVING, another only the ready service; each
    name is SERVING again once its reasons are released; after graceful shutdown began nothing
    makes it SERVING again."""

    async def run() -> None:
        servicer = health.aio.HealthServicer()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        readiness = Readiness(servicer, GENERATOR)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def both() -> tuple[int, int]:
                    replies = [await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
                               for name in ("", GENERATOR)]
                    return replies[0].status, replies[1].status

                await readiness.hold("loading", server_wide=True)
                assert await both() == (NOT_SERVING, NOT_SERVING)
                await readiness.hold("store down")
                await readiness.release("loading")
                assert await both() == (SERVING, NOT_SERVING) and readiness.reasons == ("store down",)
                await readiness.release("never held")
                assert await both() == (SERVING, NOT_SERVING)
                await readiness.release("store down")
                assert await both() == (SERVING, SERVING) and readiness.reasons == ()
                await servicer.enter_graceful_shutdown()
                await readiness.hold("store down")
                await readiness.release("store down")
                assert await both() == (NOT_SERVING, NOT_SERVING)
        finally:
            await server.stop(None)

    asyncio.run(run())


@pytest.mark.parametrize(("flag", "says"), [("--port", "cannot listen on"), ("--health-port", "cannot listen on"),
                                            ("--metrics-port", "cannot serve metrics on"),
                                            ("--http-port", "cannot serve HTTP on")])
def test_a_taken_port_is_refused_before_the_model_loads(tmp_path, flag, says):
    """The folder holds no model: a worker that loaded it before binding its ports would say
    "cannot load model" (tests/test_server.py, a folder without a model) instead."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": "0", flag: str(port)}
        proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tmp_path),
                               *(word for item in ports.items() for word in item)],
                              capture_output=True, text=True, timeout=EVENT_TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 2
    assert "kvshare listening" not in proc.stdout and "cannot load model" not in proc.stderr
    message = [line for line in proc.stderr.splitlines() if line.startswith("kvshare serve:")]
    assert len(message) == 1 and f"{says} 127.0.0.1:{port}" in message[0], proc.stderr
    assert "Traceback" not in proc.stderr


HELD = "tokenizer_config.json"
"""The file of the model folder a loading worker is held at (its chat template)."""


@pytest.fixture()
def held_model(tmp_path, tiny_model) -> Path:
    """The tiny model's folder, but its tokenizer_config.json a FIFO: a worker loading it waits,
    inside the load (after the sessions, which read the weights; the spec and tokenizer, which
    bound a request message, are read before the ports are served), until the test writes the
    real file into it."""
    folder = tmp_path / "held"
    folder.mkdir()
    for item in tiny_model.iterdir():
        if item.name != HELD:
            (folder / item.name).symlink_to(item)
    os.mkfifo(folder / HELD)
    return folder


def open_for_the_loader(fifo: Path, proc: subprocess.Popen) -> int:
    """A write end of ``fifo``, once the worker opened it to read (it is loading the model then):
    a non-blocking open for writing fails with ENXIO while nobody has it open for reading."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
        assert proc.poll() is None, "the worker exited before it loaded the model"
        assert time.monotonic() < deadline, "the worker never began loading the model"
        time.sleep(0.02)


def test_ports_answer_while_the_model_loads(held_model, tiny_model, tmp_path):
    """While the model loads, the ports are bound and answer: health NOT_SERVING (both names, on
    the gRPC port and --health-port; HTTP /health 503), calls UNAVAILABLE "the model is loading";
    once loaded, SERVING, answers, and only then the "kvshare listening" line."""
    port, health_port, http_port = free_ports(3)
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", str(held_model),
                                 "--port", str(port), "--health-port", str(health_port), "--http-port", str(http_port)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        loader = open_for_the_loader(held_model / HELD, proc)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, \
                    grpc.insecure_channel(f"127.0.0.1:{health_port}") as probe:
                for target in (channel, probe):
                    assert [check(target, name) for name in ("", GENERATOR)] == [NOT_SERVING, NOT_SERVING]
                assert http_health(http_port) == 503
                with pytest.raises(grpc.RpcError) as refused:
                    pb_grpc.GeneratorStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "the model is loading" in refused.value.details()
                assert "kvshare listening" not in log_path.read_text()

                watch = statuses(channel, GENERATOR)
                os.write(loader, (tiny_model / HELD).read_bytes())
                os.close(loader)
                loader = None
                until(watch, SERVING)
                assert check(probe, "") == SERVING and http_health(http_port) == 200
                answers(channel)
        finally:
            if loader is not None:
                os.close(loader)
        assert f"kvshare listening on 127.0.0.1:{port}" in log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(EVENT_TIMEOUT_S)


def test_cache_required_takes_the_worker_out_of_rotation_while_redis_does_not_answer(tiny_model):
    """Redis down at start, then up, killed, and up again on its port: the Generator's health
    (the API port's and --health-port's) follows it, while the whole server's ("", liveness, the
    HTTP /health) stays SERVING and calls are answered throughout."""
    redis_port, health_port, http_port = free_ports(3)
    with WorkerProcess(tiny_model, "--cache", f"redis://127.0.0.1:{redis_port}", "--cache-required",
                       "--breaker-backoff-ms", "100", "--health-port", str(health_port), "--http-port", str(http_port),
                       wait_serving=False) as w, w.channel() as channel, \
            grpc.insecure_channel(f"127.0.0.1:{health_port}") as probe:
        watches = [statuses(channel, GENERATOR), statuses(probe, GENERATOR)]
        for watch in watches:
            until(watch, NOT_SERVING)
        assert check(channel, "") == SERVING and http_health(http_port) == 200
        answers(channel)
        with RedisServer(redis_port) as redis:
            for watch in watches:
                until(watch, SERVING)
            redis.kill()
            for watch in watches:
                until(watch, NOT_SERVING)
            assert check(probe, "") == SERVING
            answers(channel)
            redis.start()
            for watch in watches:
                until(watch, SERVING)
            answers(channel)
    assert any("cache store redis does not answer: 3 checks in a row failed" in line for line in w.log_lines), w.log_lines
