"""A big request does not stop the streams already running: real workers, real gRPC on loopback.

Each case runs a long greedy stream and sends one 3.6 MB call while it runs, to a worker with the
default prompt limit (refused at once) and to one with ``--max-prompt-bytes`` raised (really
tokenized, off the event loop). The stream's longest gap between tokens while the call is answered
must stay under 10× its own median gap just before: both sides of the ratio are measured on the
same stream in the same run, so the test means the same on a fast and on a slow machine. The
stream runs on the real model (SmolLM2-135M) with one intra-op thread: its gaps are those of a
served model, not of a toy whose steps are shorter than the fixed costs a 3.6 MB call still has
(turning 880,000 token ids into Python ints holds the GIL about 25 ms).
"""

import grpc
import pytest
from tokenizers import Tokenizer

from bench.stalls import MESSAGE_BYTES, big_text, call_during_stream
from kvshare.v1 import generator_pb2 as pb
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess
GAP_RATIO = 10.0


@pytest.fixture(scope="module")
def text() -> str:
    return big_text(3.6)


@pytest.fixture(scope="module")
def workers(smollm2):
    args = ("--intra-op-threads", "1", "--max-message-bytes", str(MESSAGE_BYTES), "--max-new-tokens-cap", "4096")
    with WorkerProcess(smollm2, *args) as default, \
            WorkerProcess(smollm2, *args, "--max-prompt-bytes", str(MESSAGE_BYTES)) as raised:
        yield {"default": default, "raised": raised}


@pytest.mark.parametrize(("limit", "method", "expected"), [
    ("default", "Generate", grpc.StatusCode.INVALID_ARGUMENT),
    ("raised", "Generate", grpc.StatusCode.OUT_OF_RANGE),
    ("default", "Tokenize", grpc.StatusCode.INVALID_ARGUMENT),
    ("raised", "Tokenize", grpc.StatusCode.OK),
])
def test_a_big_call_does_not_stop_a_running_stream(workers, smollm2, text, limit, method, expected):
    request = (pb.GenerateRequest(prompt=text, max_new_tokens=16) if method == "Generate"
               else pb.TokenizeRequest(text=text)).SerializeToString()
    seen = call_during_stream(workers[limit].target, method, request)
    assert seen.status == expected, seen.answer[:300]
    assert seen.ratio < GAP_RATIO, (f"the stream's longest gap was {seen.longest_gap_ms:.0f} ms, {seen.ratio:.1f}x its "
                                    f"median, while {method} was answered")
    if seen.status == grpc.StatusCode.INVALID_ARGUMENT:
        assert b"--max-prompt-bytes" in seen.answer
    if seen.status == grpc.StatusCode.OUT_OF_RANGE:
        assert b"context length of 8192 tokens" in seen.answer
    if seen.status == grpc.StatusCode.OK:  # the ids the GIL-free path made are the library's plain encode's
        reference = Tokenizer.from_file(str(smollm2 / "tokenizer.json")).encode(text).ids
        assert list(pb.TokenizeResponse.FromString(seen.answer).token_ids) == reference
