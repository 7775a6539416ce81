"""A bug in planning ends the scheduler thread: the worker must not hang with health SERVING. It
fails what is in flight UNAVAILABLE, reports NOT_SERVING, logs the fault once with the requests in
flight, and exits non-zero so that Kubernetes restarts it. The fault is injected by a
``sitecustomize`` (``inject_schedule/``) into a real worker process; every step waits on an
answer, a status or the process's exit, never on time."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess

INJECT = Path(__file__).parent / "inject_schedule"


def test_an_exception_in_schedule_fails_in_flight_unavailable_turns_not_serving_and_exits(tiny_model):
    path = os.pathsep.join(p for p in (str(INJECT), os.environ.get("PYTHONPATH", "")) if p)
    with WorkerProcess(tiny_model, "--max-unread-tokens", "4", env={"PYTHONPATH": path}) as worker, \
            grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        statuses: list[int] = []
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="kvshare.v1.Generator"))
        first_status = threading.Event()

        def read_watch() -> None:
            try:
                for answer in watch:
                    statuses.append(answer.status)
                    first_status.set()
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read_watch, daemon=True)
        reader.start()
        assert first_status.wait(60)
        # In flight: a long stream that has sent its first message (it then pauses, unread).
        running = stub.Generate(pb.GenerateRequest(prompt="a stream in flight", max_new_tokens=400, ignore_eos=True,
                                                   request_id="in-flight"), timeout=120)
        assert next(running).token_ids
        with pytest.raises(grpc.RpcError) as exploded:
            list(stub.Generate(pb.GenerateRequest(prompt="boom", max_new_tokens=4, request_id="explode"), timeout=120))
        assert exploded.value.code() == grpc.StatusCode.UNAVAILABLE, exploded.value.details()
        with pytest.raises(grpc.RpcError) as cut:
            list(running)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value.details()
        assert "scheduler stopped" in cut.value.details()
        assert worker.wait(60) != 0, "the worker exits non-zero for its orchestrator to restart it"
        reader.join(60)
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses[1:], statuses
        critical = [line for line in worker.log_lines if "the scheduler thread stopped" in line]
        assert len(critical) == 1 and "explode" in critical[0] and "in-flight" in critical[0], critical
