"""`kvshare route` as a real subprocess in front of real `kvshare serve` workers sharing a real Redis.

Which worker served a call is read from the workers' own log lines (one per request, with the
request_id the test set). Where a call must still be running at a worker when the test acts on
it, the worker's store is a socket that accepts and never answers, so the call sits in its cache
lookup for seconds whatever the machine's speed; the test waits for it to be there (the worker's
running-requests gauge) instead of assuming how long anything takes.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import grpc
import pytest
from conftest import wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.api_keys import key_line
from services.client import complete
from services.local.redis_process import free_port
from services.local.worker_process import RouterProcess, WorkerProcess
from services.route.rendezvous import RoundRobin, choose, score
from services.route.routing_key import (
    PROMPT_TOKEN_IDS_ROUTED,
    prompt_prefix,
    routing_key,
)

pytestmark = pytest.mark.subprocess
ROOT = Path(__file__).resolve().parent.parent
GENERATE = "/kvshare.v1.Generator/Generate"
# Longer than the 256 bytes that route a prompt: prompts that differ only after it share a worker.
SYSTEM = "You are the support assistant of a bicycle shop. Answer briefly and politely. " * 4
LOG_TIMEOUT_S = 30.0
MESSAGE_CAP = 4 * 1024 * 1024
"""The fleet's --max-message-bytes, set rather than left to the default (32 MiB, room for audio)."""


@dataclass
class Candidate:
    """A worker as ``rendezvous.choose`` sees it."""

    address: str
    streams: int = 0


def served_by(workers: list[WorkerProcess], request_id: str) -> WorkerProcess:
    """The worker whose log has the end-of-request line of ``request_id`` (waits for it)."""
    found: list[WorkerProcess] = []

    def logged() -> bool:
        found[:] = [w for w in workers if any(f"request {request_id} " in line for line in w.log_lines)]
        return bool(found)

    wait_until(logged, LOG_TIMEOUT_S, f"a worker's log line for request {request_id}")
    assert len(found) == 1, f"request {request_id} logged by {len(found)} workers"
    return found[0]


def request_line(worker: WorkerProcess, request_id: str) -> str:
    return next(line for line in worker.log_lines if f"request {request_id} " in line)


def expected_worker(workers: list[WorkerProcess], request: pb.GenerateRequest, metadata=()) -> WorkerProcess:
    """The worker rendezvous hashing gives ``request``, computed here from the documented rule."""
    key = routing_key(request.SerializeToString(), metadata, 256)
    best = choose(key, [Candidate(w.target) for w in workers])
    return next(w for w in workers if w.target == best.address)


def start_workers(model: Path, *flags: tuple[str, ...]) -> list[WorkerProcess]:
    """One worker per tuple of flags, started side by side; none is left running when one fails."""
    with ThreadPoolExecutor(len(flags)) as pool:
        futures = [pool.submit(WorkerProcess, model, *f) for f in flags]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(flags):
        for worker in started:
            worker.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    return started


def kill(worker: WorkerProcess) -> None:
    """SIGKILL (no drain: the worker is gone at once), then reap."""
    os.kill(worker.pid, signal.SIGKILL)
    worker.stop()


def running(metrics_port: int) -> float:
    """The worker's kvshare_requests_running gauge: sequences holding a slot."""
    text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("kvshare_requests_running ")))


def routed_to(worker: WorkerProcess, workers: list[WorkerProcess],
              make: Callable[[int], pb.GenerateRequest]) -> pb.GenerateRequest:
    """The first of ``make(0)``, ``make(1)``, ... that rendezvous hashing gives ``worker``."""
    return next(r for r in map(make, range(1000)) if expected_worker(workers, r) is worker)


def route_env(**settings: float) -> dict[str, str]:
    """Router settings as ``KVSHARE_ROUTE_*`` variables, not flags: a router that lacks them (an
    older one) still starts, so a test shows what it does without them."""
    return {f"KVSHARE_ROUTE_{name.upper()}": str(value) for name, value in settings.items()}


@contextmanager
def frozen(worker: WorkerProcess) -> Iterator[None]:
    """``worker`` SIGSTOPped for the block (its sockets stay open, nothing answers); then SIGCONT,
    and back once its health service answers SERVING again: the module's other tests share it."""
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        with worker.channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            wait_until(serving, LOG_TIMEOUT_S, f"{worker.target} to serve again")


# 8 rows of 20 alternatives a token: megabytes of messages, far past the 64 KiB window of a stream
# on each hop (the test's channel without bandwidth probing, and the router's), so while the test
# does not read, the stream's worker holds its rows paused with the answer unfinished.
UNREAD_CHANNEL = (("grpc.http2.bdp_probe", 0),)
WIDE = {"n": 8, "logprobs": True, "top_logprobs": 20, "ignore_eos": True}


def messages(count: int) -> str:
    """How the router's statuses count the messages a caller got."""
    return f"{count} message{'' if count == 1 else 's'}"


# --- the routing rules, as pure functions ----------------------------------------------------


def test_routing_key_is_the_prompt_prefix_salt_and_caller():
    def key(request: pb.GenerateRequest, metadata=()) -> bytes:
        return routing_key(request.SerializeToString(), metadata, 256)

    same = [key(pb.GenerateRequest(prompt=SYSTEM + f"Question {i}?", max_new_tokens=i + 1)) for i in range(5)]
    assert len(set(same)) == 1, "only the first 256 bytes count"
    assert key(pb.GenerateRequest(prompt="short prompt")) != key(pb.GenerateRequest(prompt="short prompt!"))
    base = pb.GenerateRequest(prompt=SYSTEM)
    salted = pb.GenerateRequest(prompt=SYSTEM, cache=pb.CacheOptions(salt="tenant-b"))
    assert key(base) != key(salted)
    assert key(base, (("authorization", "Bearer a"),)) != key(base, (("authorization", "Bearer b"),))
    assert key(base, (("x-trace", "1"),)) == key(base), "only the authorization metadata counts"

    chat = [pb.ChatMessage(role="system", content=SYSTEM), pb.ChatMessage(role="user", content="hi")]
    other_user = [chat[0], pb.ChatMessage(role="user", content="something else")]
    assert key(pb.GenerateRequest(messages=chat)) == key(pb.GenerateRequest(messages=other_user))
    assert prompt_prefix(pb.GenerateRequest(messages=chat[1:]), 256) == b"muser\x00hi\x00"

    ids = list(range(3, 3 + PROMPT_TOKEN_IDS_ROUTED))
    assert key(pb.GenerateRequest(prompt_token_ids=ids + [7])) == key(pb.GenerateRequest(prompt_token_ids=ids + [9]))
    assert key(pb.GenerateRequest(prompt_token_ids=[5, 6])) != key(pb.GenerateRequest(prompt_token_ids=[5, 7]))
    # Multi-byte characters are cut at 256 bytes, not characters.
    assert len(prompt_prefix(pb.GenerateRequest(prompt="é" * 300), 256)) == 1 + 256

    # Encoder-decoder requests: the same audio (or encoder prompt) meets its cross K/V, whatever the prompt.
    audio = b"RIFF" + bytes(range(256)) * 40
    assert key(pb.GenerateRequest(encoder_audio=audio)) is not None
    assert key(pb.GenerateRequest(encoder_audio=audio)) != key(pb.GenerateRequest(encoder_audio=audio + b"\0"))
    assert key(pb.GenerateRequest(encoder_audio=audio)) == key(pb.GenerateRequest(encoder_audio=audio, prompt="Notes."))
    assert key(pb.GenerateRequest(encoder_prompt="Document A. " * 40, prompt="Summary:")) != \
        key(pb.GenerateRequest(encoder_prompt="Document B. " * 40, prompt="Summary:"))
    features = pb.Tensor(shape=[1, 4], dtype="float32", data=bytes(16))
    assert key(pb.GenerateRequest(encoder_features=features)) == key(pb.GenerateRequest(encoder_features=features))

    assert key(pb.GenerateRequest(max_new_tokens=4)) is None, "no prompt: round-robin, the worker refuses it"
    assert routing_key(b"\xff\xff\xff", (), 256) is None, "unparseable: round-robin, the worker refuses it"


def test_rendezvous_moves_only_the_removed_workers_keys_and_respects_the_load_bound():
    workers = [Candidate(f"10.0.0.{i}:50051") for i in range(1, 6)]
    keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(2000)]
    before = {k: choose(k, workers).address for k in keys}
    assert all(before[k] == max(workers, key=lambda w: score(k, w.address)).address for k in keys)
    counts = [sum(a == w.address for a in before.values()) for w in workers]
    assert min(counts) > 300, f"keys spread over the workers: {counts}"

    gone = workers[2]
    after = {k: choose(k, [w for w in workers if w is not gone]).address for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone.address for k in moved), "only the removed worker's keys move"
    assert all(after[k] == before[k] for k in keys if before[k] != gone.address)

    key = keys[0]
    ranked = sorted(workers, key=lambda w: score(key, w.address), reverse=True)
    ranked[0].streams = 2
    assert choose(key, workers, max_streams=2) is ranked[1], "at the bound: the next-best worker"
    assert choose(key, workers, max_streams=3) is ranked[0]
    for w in workers:
        w.streams = 2
    ranked[3].streams = 1
    assert choose(key, workers, max_streams=2) is ranked[3], "all at the bound: the least loaded"
    assert choose(key, []) is None

    turns = RoundRobin()
    assert {turns.choose(workers).address for _ in range(10)} == {w.address for w in workers}


# --- a router in front of two workers --------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tiny_model, redis_server):
    """Two workers sharing one Redis, and a router in front of them (health checked every 0.2 s);
    all three cap messages at 4 MiB, below the 5 MB prompt that must get RESOURCE_EXHAUSTED."""
    args = ("--cache", redis_server.url, "--max-new-tokens-cap", "1000", "--max-unread-tokens", "8",
            "--max-message-bytes", str(MESSAGE_CAP))
    workers = start_workers(tiny_model, args, args)
    try:
        with RouterProcess([w.target for w in workers], "--health-interval-s", "0.2",
                           "--max-message-bytes", str(MESSAGE_CAP)) as router:
            yield workers, router
    finally:
        for w in workers:
            w.stop()


@pytest.fixture()
def router_stub(fleet):
    _, router = fleet
    with grpc.insecure_channel(router.target) as channel:
        yield pb_grpc.GeneratorStub(channel)


def test_generate_streams_through_the_router_as_from_the_worker(fleet, router_stub):
    workers, router = fleet
    # Both computed (no cache read), so the comparison is exact.
    request = pb.GenerateRequest(request_id="same-tokens", prompt=SYSTEM + "Can I return a helmet?",
                                 max_new_tokens=40, ignore_eos=True, cache=pb.CacheOptions(skip_read=True))
    messages = list(router_stub.Generate(request, timeout=30))
    # At most 8 unread tokens per stream at the worker: 40 tokens arrive in several messages,
    # passed on one by one, not gathered.
    assert len(messages) >= 5 and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    via_router = [t for m in messages for t in m.token_ids]
    worker = served_by(workers, "same-tokens")
    with worker.channel() as channel:
        direct = complete(pb_grpc.GeneratorStub(channel), request, timeout_s=30)
    assert via_router == direct.token_ids and len(via_router) == 40
    assert "".join(m.text for m in messages) == direct.text

    ids = router_stub.Tokenize(pb.TokenizeRequest(text="café 🙂"), timeout=30).token_ids
    assert router_stub.Tokenize(pb.TokenizeRequest(token_ids=ids), timeout=30).text == "café 🙂"
    info = router_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.vocab_size == 512 and info.block_size == 64

    with grpc.insecure_channel(router.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvshare.v1.Generator"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        assert "kvshare.v1.Generator" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_same_prefix_lands_on_the_same_worker(fleet, router_stub):
    workers, _ = fleet
    for p in range(12):
        prefix = f"Shop {p}. {SYSTEM}"
        served = set()
        for q in range(3):
            request = pb.GenerateRequest(request_id=f"prefix-{p}-{q}", prompt=f"{prefix} Question {q}: why?",
                                         max_new_tokens=1)
            complete(router_stub, request, timeout_s=30)
            assert served_by(workers, request.request_id) is expected_worker(workers, request), request.request_id
            served.add(served_by(workers, request.request_id).target)
        assert len(served) == 1, f"prefix {p} went to {served}"


def test_cancel_mid_stream_ends_the_workers_stream(fleet, router_stub):
    workers, _ = fleet
    request = pb.GenerateRequest(request_id="cancel-mid-stream", prompt=SYSTEM + "Tell me everything.",
                                 max_new_tokens=800, ignore_eos=True)
    call = router_stub.Generate(request, timeout=60)
    next(call)
    call.cancel()
    worker = served_by(workers, "cancel-mid-stream")
    # Stopped early, unless the worker made all 800 tokens before the cancel reached it (the test
    # assumes no speed; test_client_cancel_frees_the_workers_slot pins the cancel down).
    line = request_line(worker, "cancel-mid-stream")
    assert "stopped after" in line or "finished after 800" in line, line
    complete(router_stub, pb.GenerateRequest(prompt=request.prompt, max_new_tokens=2), timeout_s=30)


def test_bad_bytes_get_invalid_argument_never_unknown(fleet, router_stub):
    _, router = fleet
    with grpc.insecure_channel(router.target) as channel:
        stream, unary = channel.unary_stream, channel.unary_unary
        cases = {
            "garbage Generate": (lambda data: list(stream(GENERATE)(data, timeout=30)), b"\xff\xff\xff"),
            "invalid UTF-8 in prompt": (lambda data: list(stream(GENERATE)(data, timeout=30)), b"\x12\x01\xff"),
            "garbage Tokenize": (lambda data: unary("/kvshare.v1.Generator/Tokenize")(data, timeout=30), b"\x0a\x05ab"),
        }
        for name, (call, data) in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                call(data)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value.details())
            assert "request is not a valid kvshare.v1." in info.value.details(), name
        # GetModelInfoRequest has no fields: the worker answers without reading the request's bytes.
        assert pb.GetModelInfoResponse.FromString(unary("/kvshare.v1.Generator/GetModelInfo")(b"\xff", timeout=30)).name
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/kvshare.v1.Generator/NoSuchMethod")(b"", timeout=30)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # A request that parses but that the worker refuses: the worker's status and details, unchanged.
    with pytest.raises(grpc.RpcError) as info:
        list(router_stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=10**6), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("max_new_tokens")
    with pytest.raises(grpc.RpcError) as info:
        list(router_stub.Generate(pb.GenerateRequest(prompt="x" * 5_000_000, max_new_tokens=1), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    complete(router_stub, pb.GenerateRequest(prompt=SYSTEM, max_new_tokens=1), timeout_s=30)  # still serves


# --- calls that must still be running at the worker --------------------------------------------


@pytest.fixture(scope="module")
def stuck_fleet(tiny_model):
    """Two workers whose store accepts connections and never answers: a call sits in its cache
    lookup for 2 x 5 s (the store's deadline, and its one retry), whatever the machine's speed. Its
    breaker never opens, so every call waits the same. Each has a metrics port."""
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(128)
        store = f"redis://127.0.0.1:{blackhole.getsockname()[1]}/0"
        args = ("--cache", store, "--cache-op-timeout-ms", "5000", "--cache-connect-timeout-ms", "5000",
                "--breaker-failures", "1000000", "--max-new-tokens-cap", "1000")
        ports = [free_port(), free_port()]
        workers = start_workers(tiny_model, *[(*args, "--metrics-port", str(p)) for p in ports])
        try:
            yield workers, ports
        finally:
            for w in workers:
                w.stop()


def test_client_cancel_frees_the_workers_slot(stuck_fleet):
    """The call is at its worker (holding a slot) when the client cancels: the worker ends it and
    frees the slot, and the router stops counting it (with a bound of one stream per worker, the
    prefix's next call goes to the same worker again)."""
    workers, ports = stuck_fleet
    with RouterProcess([w.target for w in workers], "--max-streams-per-worker", "1") as router, \
            grpc.insecure_channel(router.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for i in range(2):
            request = pb.GenerateRequest(request_id=f"cancel-at-worker-{i}", prompt=SYSTEM, max_new_tokens=800,
                                         ignore_eos=True)
            worker = expected_worker(workers, request)
            port = ports[workers.index(worker)]
            call = stub.Generate(request, timeout=60)
            wait_until(lambda p=port: running(p) == 1, LOG_TIMEOUT_S, "the call to hold a slot at its worker")
            call.cancel()
            assert served_by(workers, request.request_id) is worker
            line = request_line(worker, request.request_id)
            assert f"request {request.request_id} stopped after 0 generated tokens" in line, line
            wait_until(lambda p=port: running(p) == 0, LOG_TIMEOUT_S, "the worker's slot to be free")


def test_deadline_reaches_the_worker(stuck_fleet):
    workers, _ = stuck_fleet
    with RouterProcess([w.target for w in workers]) as router, grpc.insecure_channel(router.target) as channel:
        request = pb.GenerateRequest(request_id="deadline-1", prompt=SYSTEM, max_new_tokens=800, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=1.0))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        worker = served_by(workers, "deadline-1")
        assert worker is expected_worker(workers, request)
        assert "request deadline-1 stopped after 0 generated tokens" in request_line(worker, "deadline-1")


def test_load_bound_sends_a_busy_prefix_to_the_next_worker(stuck_fleet):
    workers, ports = stuck_fleet
    with RouterProcess([w.target for w in workers], "--max-streams-per-worker", "1") as router, \
            grpc.insecure_channel(router.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        requests = [pb.GenerateRequest(request_id=f"bound-{i}", prompt=SYSTEM + f"Question {i}", max_new_tokens=800)
                    for i in range(3)]
        first = expected_worker(workers, requests[0])
        other = next(w for w in workers if w is not first)
        calls = []
        for request, worker, slots in zip(requests, (first, other, first), (1, 1, 2), strict=True):
            calls.append(stub.Generate(request, timeout=60))
            port = ports[workers.index(worker)]
            wait_until(lambda p=port, n=slots: running(p) == n, LOG_TIMEOUT_S, f"{request.request_id} at its worker")
        for call in calls:
            call.cancel()
        # One stream each: the prefix's own worker, then the next-best; with both at the bound,
        # the least loaded (a tie: the prefix's own).
        assert [served_by(workers, r.request_id) for r in requests] == [first, other, first]


def test_a_failed_health_check_moves_a_frozen_workers_unanswered_call_to_the_other(stuck_fleet):
    """The call sits at its worker with nothing answered (in its cache lookup) when the worker
    freezes: the health check that gets no answer cuts it there, and the router tries it on the
    other worker, where it then holds a slot; the caller saw nothing of the first try."""
    workers, ports = stuck_fleet
    with RouterProcess([w.target for w in workers], "--health-interval-s", "0.2") as router, \
            grpc.insecure_channel(router.target) as channel:
        request = pb.GenerateRequest(request_id="frozen-unanswered", prompt=SYSTEM, max_new_tokens=800, ignore_eos=True)
        victim = expected_worker(workers, request)
        other = next(w for w in workers if w is not victim)
        call = pb_grpc.GeneratorStub(channel).Generate(request, timeout=60)
        try:
            wait_until(lambda: running(ports[workers.index(victim)]) == 1, LOG_TIMEOUT_S, "the call at its worker")
            with frozen(victim):
                wait_until(lambda: running(ports[workers.index(other)]) == 1, LOG_TIMEOUT_S,
                           "the call to be tried again at the other worker")
        finally:
            call.cancel()
        assert any(f"{GENERATE}: worker {victim.target} failed a health check (DEADLINE_EXCEEDED" in line
                   and line.endswith("; trying the next-best worker") for line in router.log_lines), router.log_lines
        for port in ports:
            wait_until(lambda p=port: running(p) == 0, LOG_TIMEOUT_S, "both workers' slots to be free")


# --- workers that go away -----------------------------------------------------------------------


def test_a_stopped_worker_loses_its_prefixes_to_the_other(tiny_model, redis_url):
    """Router A checks health every 0.2 s and moves the prefix when the worker reports NOT_SERVING
    (it still takes calls for 60 s); router B never checks again after its start, and moves the
    prefix when a call fails UNAVAILABLE (the worker killed), retrying that call on the other.
    A stream in flight through each: A's finishes at the draining worker (NOT_SERVING cuts
    nothing), B's ends UNAVAILABLE naming the killed worker and the messages passed on."""
    args = ("--cache", redis_url, "--not-serving-s", "60")
    workers = start_workers(tiny_model, args, args)
    try:
        targets = [w.target for w in workers]
        with RouterProcess(targets, "--health-interval-s", "0.2") as checking, \
                RouterProcess(targets, "--health-interval-s", "3600") as unchecking, \
                grpc.insecure_channel(checking.target) as c1, grpc.insecure_channel(unchecking.target) as c2, \
                grpc.insecure_channel(checking.target, options=UNREAD_CHANNEL) as wide1, \
                grpc.insecure_channel(unchecking.target, options=UNREAD_CHANNEL) as wide2:
            via_checking, via_unchecking = pb_grpc.GeneratorStub(c1), pb_grpc.GeneratorStub(c2)
            asked = iter(range(1000))

            def ask(stub) -> WorkerProcess:
                i = next(asked)
                request = pb.GenerateRequest(request_id=f"failover-{i}", prompt=SYSTEM + f"Question {i}?",
                                             max_new_tokens=2)
                complete(stub, request, timeout_s=30)
                return served_by(workers, request.request_id)

            home = ask(via_checking)
            other = next(w for w in workers if w is not home)
            assert ask(via_unchecking) is home
            # In flight at home while the test does not read them (WIDE: far more than the windows).
            wide = pb.GenerateRequest(prompt=SYSTEM + "Everything?", max_new_tokens=200, **WIDE)
            draining, dying = (pb_grpc.GeneratorStub(c).Generate(wide, timeout=60) for c in (wide1, wide2))
            drained, cut = [next(draining)], [next(dying)]

            os.kill(home.pid, signal.SIGTERM)  # NOT_SERVING for 60 s, still taking calls
            wait_until(lambda: any(f"worker {home.target} is unhealthy (health check: NOT_SERVING)" in line
                                   for line in checking.log_lines), LOG_TIMEOUT_S, "router A to see NOT_SERVING")
            assert [ask(via_checking) for _ in range(3)] == [other] * 3
            drained += list(draining)
            assert [m.finish_reason for m in drained if m.finish_reason] == [pb.FINISH_REASON_LENGTH] * WIDE["n"]

            kill(home)
            assert [ask(via_unchecking) for _ in range(3)] == [other] * 3, "retried on the other worker"
            assert any(f"worker {home.target} is unhealthy (UNAVAILABLE" in line for line in unchecking.log_lines)
            with pytest.raises(grpc.RpcError) as info:
                for message in dying:
                    cut.append(message)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details().startswith(f"worker {home.target} failed mid-stream ("), info.value.details()
            assert info.value.details().endswith(f": the output was cut off after {messages(len(cut))}")
    finally:
        for w in workers:
            w.stop(timeout_s=1)  # the one not killed would report NOT_SERVING for 60 s


def test_a_worker_leaving_discovery_keeps_its_channel_until_its_calls_end(fleet):
    """The worker set as DNS discovery drives it (here from a list the test changes): a worker
    that leaves gets no new calls at once, its calls in flight finish on its channel, and the
    channel closes after the last; with no worker left the router says NOT_SERVING."""
    import asyncio

    from services.route.upstreams import UpstreamSet

    workers, _ = fleet

    @dataclass
    class Listed:
        addresses: list[str]
        interval_s: float = 0.05

        async def resolve(self) -> list[str]:
            return list(self.addresses)

    async def eventually(predicate, what: str) -> None:
        for _ in range(int(LOG_TIMEOUT_S / 0.01)):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}")

    async def run() -> None:
        listed, serving = Listed([w.target for w in workers]), []

        async def on_serving(now: bool) -> None:
            serving.append(now)

        upstreams = UpstreamSet(listed, health_interval_s=0.05, health_timeout_s=5.0, on_serving=on_serving)
        await upstreams.start()
        try:
            staying, leaving = sorted(upstreams.members, key=lambda u: u.address != workers[0].target)
            assert upstreams.healthy() == upstreams.members and serving == [True]
            with upstreams.using(leaving, stream=True) as channel:
                listed.addresses = [staying.address]
                await eventually(lambda: leaving.retired, "the worker to leave")
                assert upstreams.members == [staying] and upstreams.healthy() == [staying]
                info = await channel.unary_unary("/kvshare.v1.Generator/GetModelInfo")(b"", timeout=30)
                assert pb.GetModelInfoResponse.FromString(info).vocab_size == 512, "its channel still works"
            await eventually(lambda: leaving.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN,
                             "its channel to close")
            assert staying.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN
            listed.addresses = []
            await eventually(lambda: serving == [True, False], "NOT_SERVING without workers")
        finally:
            await upstreams.close()

    asyncio.run(run())


def test_no_healthy_worker_is_unavailable_and_not_serving():
    port = free_port()  # nothing listens there
    with RouterProcess([f"127.0.0.1:{port}"], wait_serving=False) as router, \
            grpc.insecure_channel(router.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = pb_grpc.GeneratorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=1), timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "no healthy worker among 1"
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --- frozen workers -------------------------------------------------------------------------------


def test_a_frozen_workers_calls_are_answered_by_the_other_after_the_first_response_timeout(fleet):
    """The router checks health only at its start, so a frozen worker stays in its set: a call it
    gets waits --first-response-timeout-s unanswered, is cancelled there and answered by the other
    worker (Generate by its prefix, Tokenize in turn); the caller sees only the answer."""
    workers, _ = fleet
    victim, other = workers
    request = routed_to(victim, workers, lambda i: pb.GenerateRequest(
        request_id=f"frozen-first-{i}", prompt=f"Frozen {i}. {SYSTEM}", max_new_tokens=4, ignore_eos=True))
    with RouterProcess([w.target for w in workers], "--health-interval-s", "3600",
                       env=route_env(first_response_timeout_s=1)) as router, \
            grpc.insecure_channel(router.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        with frozen(victim):
            messages = list(stub.Generate(request, timeout=LOG_TIMEOUT_S))
            assert served_by(workers, request.request_id) is other
            # Round-robin: one of two calls goes to the frozen worker.
            tokenized = [stub.Tokenize(pb.TokenizeRequest(text="café"), timeout=LOG_TIMEOUT_S) for _ in range(2)]
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len([t for m in messages for t in m.token_ids]) == 4
        with other.channel() as direct:
            expected = pb_grpc.GeneratorStub(direct).Tokenize(pb.TokenizeRequest(text="café"), timeout=30)
        assert tokenized == [expected, expected]
        waited = f"worker {victim.target} sent no response within 1 s (--first-response-timeout-s); trying the next-best worker"
        for method in ("Generate", "Tokenize"):
            assert any(line.endswith(f"/kvshare.v1.Generator/{method}: {waited}") for line in router.log_lines), method


@pytest.mark.parametrize("cut_by", ["stream idle timeout", "failed health check"])
def test_a_frozen_workers_stream_ends_unavailable_naming_it_and_the_messages_passed_on(fleet, cut_by):
    """The stream has passed messages on when its worker freezes: no retry (the caller holds part of
    an answer), but UNAVAILABLE, naming the worker, why the router gave up on it, and how many
    messages the caller got before the cut; the router's bound, not the caller's deadline, ends it."""
    workers, _ = fleet
    victim = workers[1]
    request = routed_to(victim, workers, lambda i: pb.GenerateRequest(
        request_id=f"frozen-mid-{cut_by[0]}-{i}", prompt=f"Frozen stream {i}.", max_new_tokens=800, **WIDE))
    idle = cut_by == "stream idle timeout"
    flags = ("--health-interval-s", "3600") if idle else ("--health-interval-s", "0.2")
    with RouterProcess([w.target for w in workers], *flags, env=route_env(stream_idle_timeout_s=1) if idle else None) \
            as router, grpc.insecure_channel(router.target, options=UNREAD_CHANNEL) as channel:
        call = pb_grpc.GeneratorStub(channel).Generate(request, timeout=LOG_TIMEOUT_S)
        received = [next(call)]
        with frozen(victim), pytest.raises(grpc.RpcError) as info:
            for message in call:
                received.append(message)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    details = info.value.details()
    cause = (f"worker {victim.target} sent nothing for 1 s (--stream-idle-timeout-s)" if idle
             else f"worker {victim.target} failed a health check (DEADLINE_EXCEEDED")
    assert details.startswith(cause), details
    assert details.endswith(f": the output was cut off after {messages(len(received))}"), details
    assert not any(m.finish_reason for m in received), "cut off before a row finished"


# --- metadata, discovery, settings ---------------------------------------------------------------


def test_api_keys_pass_through_and_dns_discovery(tiny_model, tmp_path):
    key = "route-test-key-0123456789"
    keys = tmp_path / "api-keys"
    keys.write_text(key_line("acme", key))
    with WorkerProcess(tiny_model, "--api-keys-file", str(keys)) as worker:
        port = worker.target.rsplit(":", 1)[1]
        # localhost may resolve to ::1 as well, where nothing listens: that record is unhealthy.
        with RouterProcess([], "--workers-dns", f"localhost:{port}", "--discovery-interval-s", "0.5") as router, \
                grpc.insecure_channel(router.target) as channel:
            assert any("workers: " in line and f"127.0.0.1:{port}" in line for line in router.log_lines)
            stub = pb_grpc.GeneratorStub(channel)
            request = pb.GenerateRequest(prompt=SYSTEM, max_new_tokens=2, ignore_eos=True)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
            done = complete(stub, request, timeout_s=30, metadata=(("authorization", f"Bearer {key}"),))
            assert done.last.usage.completion_tokens == 2


@pytest.mark.parametrize(("args", "env", "says"), [
    ([], {}, "exactly one of --workers"),
    (["--workers", "a:1", "--workers-dns", "b:2"], {}, "exactly one of --workers"),
    (["--workers", "a:1,b"], {}, "--workers: 'b' is not HOST:PORT"),
    ([], {"KVSHARE_ROUTE_WORKERS": "a:1", "KVSHARE_ROUTE_HEALTH_INTERVAL_S": "0"},
     "--health-interval-s (env KVSHARE_ROUTE_HEALTH_INTERVAL_S) must be"),
])
def test_route_settings_are_checked_at_start(args, env, says):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "route", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
