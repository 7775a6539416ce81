"""Fuzzed requests against a live worker: no answer is UNKNOWN or INTERNAL (a server fault), none
hangs, and the worker still serves afterwards.

Two kinds, by hypothesis with a fixed derivation (derandomized, no example database), so CI runs
the same examples every time: raw request bytes (random, and valid requests cut short, with bytes
flipped or with invalid UTF-8 in a string field), sent to each method through a channel that does
no serializing; and well-formed requests with hostile fields (any Unicode text, huge and negative
numbers, NaN, many stop strings, many messages). The worker's model has a chat template that
refuses some conversations, so messages reach the template too.
"""

import json
import shutil
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete, raw_call
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess
SERVER_FAULTS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
METHODS = ("Generate", "Tokenize", "GetModelInfo")
REQUEST_TYPES = {"Generate": pb.GenerateRequest, "Tokenize": pb.TokenizeRequest, "GetModelInfo": pb.GetModelInfoRequest}
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user message') }}{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def fuzzed(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with WorkerProcess(folder, "--max-new-tokens-cap", "24") as worker, grpc.insecure_channel(worker.target) as channel:
        yield channel


def answered(channel: grpc.Channel, method: str, request: bytes, seen: Counter) -> grpc.StatusCode:
    status, details = raw_call(channel, method, request, timeout_s=60)
    seen[f"{method} {status.name}"] += 1
    assert status not in SERVER_FAULTS, f"{method} answered {status.name}: {details[:500]!r} for {request[:200]!r}"
    return status


# Each field is often valid and sometimes hostile, so that whole requests get through too.
int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
token_ids = st.one_of(st.lists(st.integers(3, 511), min_size=1, max_size=40), st.lists(int32, max_size=40))
texts = st.text(max_size=120)
messages = st.lists(st.builds(pb.ChatMessage, role=st.one_of(st.sampled_from(["user", "assistant", "system"]), texts),
                              content=texts), max_size=30)
floats = st.floats(width=32)
stops = st.one_of(st.just([]), st.lists(st.text(min_size=1, max_size=8), max_size=4),
                  st.lists(st.text(max_size=8), max_size=70), st.lists(st.text(min_size=250, max_size=300), max_size=2))
prompt_forms = st.one_of(st.sampled_from([{"prompt"}, {"ids"}, {"messages"}]),
                         st.sets(st.sampled_from(["prompt", "ids", "messages", "encoder"]), max_size=3))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=draw(st.one_of(st.text(max_size=20), st.text(max_size=300))),
        max_new_tokens=draw(st.one_of(st.integers(1, 24), st.integers(0, 30), uint32)),
        stop=draw(stops), ignore_eos=draw(st.booleans()),
        cache=pb.CacheOptions(skip_read=draw(st.booleans()), skip_write=draw(st.booleans()), salt=draw(texts)),
        sampling=pb.SamplingParams(temperature=draw(st.one_of(st.just(0.0), st.floats(0, 2), floats)),
                                   top_k=draw(st.one_of(st.integers(0, 100), uint32))),
    )
    if draw(st.booleans()):
        request.sampling.top_p = draw(st.one_of(st.floats(0.01, 1.0), floats))
    if draw(st.booleans()):
        request.sampling.seed = draw(st.integers(0, 2**64 - 1))
    # One of the prompt forms, or none, or several (those two are refusals).
    for form in draw(prompt_forms):
        if form == "prompt":
            request.prompt = draw(st.text(max_size=2000))
        elif form == "ids":
            request.prompt_token_ids.extend(draw(token_ids))
        elif form == "messages":
            request.messages.extend(draw(messages))
        else:
            request.encoder_prompt = draw(texts)
            request.encoder_prompt_token_ids.extend(draw(token_ids))
            request.encoder_features.shape.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)))
            request.encoder_features.dtype = draw(st.sampled_from(["float32", "float16", "int8", ""]))
            request.encoder_audio = draw(st.binary(max_size=64))
    return request


@st.composite
def tokenize_requests(draw) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest()
    for form in draw(st.sets(st.sampled_from(["text", "ids", "messages"]), max_size=2)):
        if form == "text":
            request.text = draw(st.text(max_size=3000))
        elif form == "ids":
            request.token_ids.extend(draw(token_ids))
        else:
            request.messages.extend(draw(messages))
    return request


def damaged(data: bytes, draw) -> bytes:
    """``data`` cut short, with bytes flipped, or with a string field of invalid UTF-8 added."""
    how = draw(st.sampled_from(["cut", "flip", "bad utf-8"]))
    if how == "cut":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    # Field 1 or 2 as a length-delimited string holding bytes that are not UTF-8.
    bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"ok\xe2\x82"]))
    return data + bytes([draw(st.sampled_from([0x0A, 0x12])), len(bad)]) + bad


@st.composite
def raw_requests(draw) -> tuple[str, bytes]:
    method = draw(st.sampled_from(METHODS))
    kind = draw(st.sampled_from(["random", "damaged"]))
    if kind == "random":
        return method, draw(st.binary(max_size=300))
    valid = {"Generate": generate_requests(), "Tokenize": tokenize_requests(), "GetModelInfo": st.just(pb.GetModelInfoRequest())}
    return method, damaged(draw(valid[method]).SerializeToString(), draw)


def fuzz(channel: grpc.Channel, cases: st.SearchStrategy, check) -> Counter:
    """Runs ``check(channel, case, seen)`` on 250 derandomized cases; returns the status counts
    (``method STATUS``), printed with ``pytest -s``."""
    seen: Counter = Counter()

    @settings(FUZZ, max_examples=250)
    @given(case=cases)
    def run(case):
        check(channel, case, seen)

    run()
    print(f"\nstatuses: {dict(sorted(seen.items()))}")
    return seen


def still_serves(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    request = pb.GenerateRequest(prompt="still here", max_new_tokens=3, ignore_eos=True)
    assert complete(pb_grpc.GeneratorStub(channel), request, timeout_s=30).last.usage.completion_tokens == 3


def raw_bytes_answered(channel: grpc.Channel, case: tuple[str, bytes], seen: Counter) -> None:
    method, data = case
    status = answered(channel, method, data, seen)
    if not REQUEST_TYPES[method].DESCRIPTOR.fields:
        # GetModelInfoRequest has no fields: its bytes are never read, whatever they are.
        assert status == grpc.StatusCode.OK
        return
    try:
        REQUEST_TYPES[method].FromString(data)
    except Exception:  # noqa: BLE001 - any parse failure
        assert status == grpc.StatusCode.INVALID_ARGUMENT


def test_raw_request_bytes(fuzzed):
    """Each method gets fuzzed bytes; the worker still serves afterwards (each test fuzzes and checks on
    its own, so they pass in any order and alone)."""
    seen = fuzz(fuzzed, raw_requests(), raw_bytes_answered)
    assert {key.split()[0] for key in seen} == set(METHODS)
    still_serves(fuzzed)


def test_hostile_fields(fuzzed):
    """Well-formed requests with hostile fields: some get through (OK) for both methods that take fields,
    and the worker still serves afterwards."""
    seen = fuzz(fuzzed, st.one_of(generate_requests().map(lambda r: ("Generate", r)),
                                  tokenize_requests().map(lambda r: ("Tokenize", r))),
                lambda channel, case, seen: answered(channel, case[0], case[1].SerializeToString(), seen))
    assert "Generate OK" in seen and "Tokenize OK" in seen
    still_serves(fuzzed)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("how", "data"), [
    ("invalid UTF-8 in a string field", b"\x0a\x02\xc3\x28"),
    ("truncated", pb.GenerateRequest(prompt="hello there").SerializeToString()[:-3]),
])
def test_unparseable_bytes_are_invalid_argument(fuzzed, method, how, data):
    status, details = raw_call(fuzzed, method, data, timeout_s=30)
    if method == "GetModelInfo":
        # GetModelInfoRequest has no fields: its bytes are never read (a call answered at once holds
        # none of them), so none can be unparseable.
        assert status == grpc.StatusCode.OK
        return
    assert status == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.decode().startswith(f"request is not a valid {REQUEST_TYPES[method].DESCRIPTOR.full_name}: ")
