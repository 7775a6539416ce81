"""A big request does not stop the streams already running: real workers, real gRPC on loopback.

Each case runs a long greedy stream and sends one 3.6 MB call while it runs, to a worker with the
default prompt limit (refused at once) and to one with ``--max-prompt-bytes`` raised (really
tokenized, off the event loop). The stream's longest gap between tokens while the call is answered
must stay under 10× its own median gap just before: both sides of the ratio are measured on the
same stream in the same run, so the test means the same on a fast and on a slow machine. The bench
preset with one intra-op thread makes decode steps long and regular next to scheduling noise.
"""

import statistics
import time

import grpc
import numpy as np
import pytest
from tokenizers import Tokenizer

from bench.stalls import (
    MESSAGE_BYTES,
    RunningStream,
    big_text,
    raw_call,
    stream_request,
)
from kvshare.v1 import generator_pb2 as pb
from services.local.worker_process import WorkerProcess
from services.runtime.kv_layout import KVLayout

pytestmark = pytest.mark.subprocess
GAP_RATIO = 10.0


@pytest.fixture(scope="module")
def bench_folder(model_dirs):
    return model_dirs["bench", KVLayout.SEPARATE]


@pytest.fixture(scope="module")
def text() -> str:
    return big_text(3.6)


@pytest.fixture(scope="module")
def workers(bench_folder):
    args = ("--intra-op-threads", "1", "--max-message-bytes", str(MESSAGE_BYTES), "--max-new-tokens-cap", "4096")
    with WorkerProcess(bench_folder, *args) as default, \
            WorkerProcess(bench_folder, *args, "--max-prompt-bytes", str(MESSAGE_BYTES)) as raised:
        yield {"default": default, "raised": raised}


def call_during_stream(worker: WorkerProcess, method: str, request: bytes) -> tuple[grpc.StatusCode, bytes, float]:
    """(status, response bytes or details, longest gap of a running stream while the call was
    answered ÷ the median of its 100 gaps before)."""
    stream = RunningStream(worker.target, stream_request(3000))
    try:
        stream.wait_for_tokens(150)
        median = statistics.median(np.diff(stream.arrivals[-101:]))
        with grpc.insecure_channel(worker.target, options=[("grpc.max_receive_message_length", MESSAGE_BYTES)]) as ch:
            start = time.perf_counter()
            status, answer = raw_call(ch, method, request, timeout_s=300)
            end = time.perf_counter()
        stream.wait_for_tokens(5)  # the gap that was open when the answer came has closed
        longest = stream.gaps_ms(start, end).max() / 1e3
    finally:
        stream.cancel()
    return status, answer, longest / median


@pytest.mark.parametrize(("limit", "method", "expected"), [
    ("default", "Generate", grpc.StatusCode.INVALID_ARGUMENT),
    ("raised", "Generate", grpc.StatusCode.OUT_OF_RANGE),
    ("default", "Tokenize", grpc.StatusCode.INVALID_ARGUMENT),
    ("raised", "Tokenize", grpc.StatusCode.OK),
])
def test_a_big_call_does_not_stop_a_running_stream(workers, bench_folder, text, limit, method, expected):
    request = (pb.GenerateRequest(prompt=text, max_new_tokens=16) if method == "Generate"
               else pb.TokenizeRequest(text=text)).SerializeToString()
    status, answer, ratio = call_during_stream(workers[limit], method, request)
    assert status == expected, answer[:300]
    assert ratio < GAP_RATIO, f"the stream's longest gap was {ratio:.1f}x its median while {method} ran"
    if status == grpc.StatusCode.INVALID_ARGUMENT:
        assert b"--max-prompt-bytes" in answer
    if status == grpc.StatusCode.OUT_OF_RANGE:
        assert b"context length of 4096 tokens" in answer
    if status == grpc.StatusCode.OK:  # the ids the GIL-free path made are the library's plain encode's
        reference = Tokenizer.from_file(str(bench_folder / "tokenizer.json")).encode(text).ids
        assert list(pb.TokenizeResponse.FromString(answer).token_ids) == reference
