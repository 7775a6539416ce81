"""The door comes before the body: a call the worker would refuse (every Tokenize or audio place
taken, a client over its half of them) is refused RESOURCE_EXHAUSTED on its headers, before gRPC
reads its request message. A place is held here by a call whose message has not come yet (sent as
a request stream that waits on an event): what the worker admits, it must hold a place for until
the body arrives, so a flood behind it finds the door shut. Nothing here waits on time: each step
waits for a refusal or an answer."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_encoder_audio import CLIP, PROMPT, whisper_audio  # noqa: F401 - the fixture is used here too

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.api_keys import key_line
from services.local.redis_process import free_port
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess

TOKENIZE, GENERATE = "/kvshare.v1.Generator/Tokenize", "/kvshare.v1.Generator/Generate"
BIG_TEXT = "lorem ipsum " * 50_000  # 600 KB: seconds of tokenizing, were it read
AUDIO_BYTES = 20 * 1024 * 1024
CALL_S = 300
"""A failsafe on each held call and its message, not a measure: each test ends on an answer."""


def bodiless(channel: grpc.Channel, request: pb.GenerateRequest | pb.TokenizeRequest, send: threading.Event,
             metadata: tuple = ()):
    """A call whose request message is sent only once ``send`` is set (it goes out as a request
    stream: on the wire, the same as a unary request that is slow to come): Generate for a
    GenerateRequest (its responses, an iterator that is also a future), else Tokenize (a future)."""
    def messages():
        send.wait(CALL_S)
        yield request

    serialize = type(request).SerializeToString
    if isinstance(request, pb.GenerateRequest):
        call = channel.stream_stream(GENERATE, request_serializer=serialize,
                                     response_deserializer=pb.GenerateResponse.FromString)
        return call(messages(), timeout=CALL_S, metadata=metadata)
    call = channel.stream_unary(TOKENIZE, request_serializer=serialize,
                                response_deserializer=pb.TokenizeResponse.FromString)
    return call.future(messages(), timeout=CALL_S, metadata=metadata)


@contextmanager
def held_call(channel: grpc.Channel, request: pb.GenerateRequest | pb.TokenizeRequest,
              probe: Callable[[], bool]) -> Iterator[threading.Event]:
    """A ``bodiless`` call, yielded with its event once it holds its place: ``probe()``, a call of
    the same client, is refused. A held call that lost the place to a probe (refused at the door
    itself) is made again. On leaving, the event is set and the call's outcome awaited."""
    deadline = time.monotonic() + 120  # a failsafe, not a measure: each try ends on an answer
    while True:
        send = threading.Event()
        outcome = bodiless(channel, request, send)
        while not outcome.done() and not probe():
            assert time.monotonic() < deadline, "timed out waiting for the held call's place"
        if not outcome.done():
            break
        assert outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.details()
    try:
        yield send
    finally:
        send.set()
        if isinstance(request, pb.GenerateRequest):
            assert [m for m in outcome], "the held call was answered once its message came"
        else:
            assert outcome.result().token_ids, "the held call was answered once its message came"


def refused(call) -> grpc.RpcError | None:
    """The RESOURCE_EXHAUSTED refusal of ``call()``, or None when it was answered."""
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        return exc
    return None


@pytest.fixture(scope="module")
def tokenize_worker(tiny_model):
    with WorkerProcess(tiny_model, "--max-tokenize-requests", "2") as worker:
        yield worker


def test_a_tokenize_flood_is_refused_at_the_door_and_generate_never_waits_behind_it(tokenize_worker):
    """With --max-tokenize-requests 2, one client holds at most 1 place: while its held call waits
    for its body, every Tokenize of that client is refused at the door, a flood of 600 KB bodies
    included, and its Generate calls are served meanwhile (they never queue behind Tokenize)."""
    with grpc.insecure_channel(tokenize_worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        def probe() -> bool:
            return refused(lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=60)) is not None

        with held_call(channel, pb.TokenizeRequest(text="hello"), probe=probe):
            flood = [stub.Tokenize.future(pb.TokenizeRequest(text=BIG_TEXT), timeout=60) for _ in range(20)]
            outcomes = [refused(f.result) for f in flood]
            assert all(outcomes), "every Tokenize of the client holding its place was refused"
            assert all("the most one client may (1: half of --max-tokenize-requests 2)" in e.details() for e in outcomes)
            answer = list(stub.Generate(pb.GenerateRequest(prompt="hello", max_new_tokens=3, ignore_eos=True),
                                        timeout=60))
            assert sum(len(m.token_ids) for m in answer) == 3
        assert stub.Tokenize(pb.TokenizeRequest(text="hello again"), timeout=60).token_ids


class CountingProxy:
    """A TCP relay in front of ``target`` that counts the bytes it passed from client to server."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.upstream_bytes = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
                if upstream:
                    with self._lock:
                        self.upstream_bytes += len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


def test_audio_beyond_the_door_is_refused_before_its_body_is_read(whisper_audio):  # noqa: F811
    """--max-audio-requests 2: one client holds 1 place. While its held call waits, a 20 MiB audio
    request of the same client is refused RESOURCE_EXHAUSTED, and no more than HTTP/2 flow control
    lets a client send unread crossed the wire: one stream window, the worker's 256 KiB (with gRPC's
    BDP probing, which the worker turns off, 4 MiB here). Read whole, as a unary registration does
    before any handler runs, all 20 MiB would have crossed."""
    with WorkerProcess(whisper_audio, "--max-audio-requests", "2") as worker, \
            grpc.insecure_channel(worker.target) as channel:
        held = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, ignore_eos=True, encoder_audio=CLIP)
        stub = pb_grpc.GeneratorStub(channel)
        probe = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=1, encoder_audio=CLIP)
        with held_call(channel, held,
                       probe=lambda: refused(lambda: list(stub.Generate(probe, timeout=60))) is not None):
            proxy = CountingProxy(worker.target)
            try:
                with grpc.insecure_channel(proxy.target, options=[("grpc.max_send_message_length", 64 << 20)]) as far:
                    big = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=1,
                                             encoder_audio=CLIP + b"\0" * (AUDIO_BYTES - len(CLIP)))
                    exc = refused(lambda: list(pb_grpc.GeneratorStub(far).Generate(big, timeout=60)))
                    assert exc is not None and "--max-audio-requests 2" in exc.details(), exc
                    assert proxy.upstream_bytes < 1 << 20, f"{proxy.upstream_bytes} bytes of the refused call were sent"
            finally:
                proxy.close()


KEYS = {name: f"{name}-key-" + str(i) * 32 for i, name in enumerate(("a", "b", "c"))}


def test_places_held_by_calls_whose_bodies_never_come_are_taken_back_for_another_client(tiny_model, tmp_path):
    """--max-tokenize-requests 4, three tenants: a and b each hold their 2 places with calls whose
    messages do not come. Tenant c's Tokenize is still served: it takes the oldest such place of a
    client holding more than it would, and that call is refused RESOURCE_EXHAUSTED. Two clients
    could otherwise keep every other client's Tokenize out for as long as they kept reopening."""

    keys = tmp_path / "api-keys"
    keys.write_text("".join(key_line(t, k) for t, k in KEYS.items()))
    with WorkerProcess(tiny_model, "--max-tokenize-requests", "4", "--api-keys-file", str(keys)) as worker, \
            grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        send = threading.Event()
        deadline = time.monotonic() + 120  # a failsafe, not a measure: each step ends on an answer

        def hold(tenant: str) -> list[grpc.Future]:
            """Two calls of ``tenant`` holding its two places (one refused at the door, having lost
            the race for a place to a probe, is made again)."""
            calls: list[grpc.Future] = []
            metadata = (("authorization", f"Bearer {KEYS[tenant]}"),)
            while True:
                calls = [c for c in calls if not c.done()]
                calls += [bodiless(channel, pb.TokenizeRequest(text="late"), send, metadata)
                          for _ in range(2 - len(calls))]
                if refused(lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=60, metadata=metadata)) \
                        and not any(c.done() for c in calls):
                    return calls
                assert time.monotonic() < deadline, f"timed out waiting for tenant {tenant}'s two places"

        held: list[grpc.Future] = []
        try:
            held = hold("a") + hold("b")
            answer = stub.Tokenize(pb.TokenizeRequest(text="hello"), timeout=60,
                                   metadata=(("authorization", f"Bearer {KEYS['c']}"),))
            assert answer.token_ids, "tenant c was served"
            while not any(f.done() for f in held):
                assert time.monotonic() < deadline, "timed out waiting for the place taken back"
            taken = next(f for f in held if f.done())
            assert taken.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "refused before its message arrived" in taken.exception().details()
        finally:
            send.set()
        outcomes = [f.exception() for f in held]
        assert sum(e is None for e in outcomes) == 3, "the other held calls were answered once their messages came"


def test_a_message_longer_than_any_valid_request_is_refused_on_its_length(tiny_model):
    """A text model's worker reads no request message longer than its largest valid request
    (``RequestLimits.message_bytes``: ~170 KB for the tiny model), so a 4 MiB prompt is refused
    RESOURCE_EXHAUSTED by gRPC on the message's length prefix, and no more than one stream window
    of it crossed the wire: before, the worker read all 4 MiB (its limit was --max-message-bytes,
    32 MiB) and then refused the prompt, and a call whose message never ended held what it had."""
    with WorkerProcess(tiny_model) as worker:
        proxy = CountingProxy(worker.target)
        try:
            with grpc.insecure_channel(proxy.target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
                big = pb.GenerateRequest(prompt="a" * (4 << 20), max_new_tokens=1)
                exc = refused(lambda: list(pb_grpc.GeneratorStub(channel).Generate(big, timeout=60)))
                assert exc is not None and "larger than max" in exc.details(), exc
                assert proxy.upstream_bytes < 1 << 20, f"{proxy.upstream_bytes} bytes of the refused call were sent"
                answer = list(pb_grpc.GeneratorStub(channel).Generate(
                    pb.GenerateRequest(prompt="hello", max_new_tokens=2, ignore_eos=True), timeout=60))
                assert sum(len(m.token_ids) for m in answer) == 2
        finally:
            proxy.close()


def test_calls_whose_messages_are_arriving_hold_receiving_places(tiny_model):
    """--max-message-bytes 65536 and --max-receiving-bytes 131072: the fewest receiving places, 4,
    may have messages arriving at once, one client's at most 2. While two text Generate calls of
    this client wait for their messages, its next Generate and its health check on the API port
    are refused RESOURCE_EXHAUSTED naming the bound; GetModelInfo, whose request has no fields, is
    answered unread; once the messages came, the calls are served."""
    with WorkerProcess(tiny_model, "--max-message-bytes", "65536", "--max-receiving-bytes", "131072") as worker, \
            grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        probe = pb.GenerateRequest(prompt="hi", max_new_tokens=1)
        send = threading.Event()
        held: list = []
        deadline = time.monotonic() + 120  # a failsafe, not a measure: each step ends on an answer
        try:
            while True:
                held = [c for c in held if not c.done()]
                held += [bodiless(channel, pb.GenerateRequest(prompt="late", max_new_tokens=2, ignore_eos=True), send)
                         for _ in range(2 - len(held))]
                exc = refused(lambda: list(stub.Generate(probe, timeout=60)))
                if exc and not any(c.done() for c in held):
                    break
                assert time.monotonic() < deadline, "timed out waiting for the two held calls' places"
            assert "the most one client may (2: half of --max-receiving-bytes 131072 over messages of up to 65536 " \
                   "bytes: 4)" in exc.details(), exc.details()
            health = health_pb2_grpc.HealthStub(channel)
            assert refused(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=60)) is not None
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).name
        finally:
            send.set()
        assert all(sum(len(m.token_ids) for m in call) == 2 for call in held)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=60).status == health_pb2.HealthCheckResponse.SERVING


def test_a_draining_worker_ends_calls_whose_message_has_not_come(tiny_model):
    """SIGTERM with --drain-s 600: a call whose message never comes holds no work, so the drain
    ends it UNAVAILABLE at once ("send the request to another replica") rather than waiting 600 s
    for it, and the worker exits by itself (it used to hold its shutdown for the whole drain). The
    call is a Tokenize holding one of --max-tokenize-requests 2 (its client's half)."""
    with WorkerProcess(tiny_model, "--drain-s", "600", "--max-tokenize-requests", "2") as worker, \
            grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        send = threading.Event()
        call = bodiless(channel, pb.TokenizeRequest(text="late"), send)
        deadline = time.monotonic() + 120  # a failsafe, not a measure: the loop ends on a refusal
        while not refused(lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=60)) or call.done():
            if call.done():  # refused at its own door, a probe having taken the place first: again
                call = bodiless(channel, pb.TokenizeRequest(text="late"), send)
            assert time.monotonic() < deadline, "the bodiless call never held its place"
        try:
            os.kill(worker.pid, signal.SIGTERM)
            ended = call.exception(120)
            assert ended is not None and ended.code() == grpc.StatusCode.UNAVAILABLE, ended
            assert "shutting down" in ended.details()
            assert worker.wait(120) == 0
        finally:
            send.set()


def test_the_health_port_reads_no_request_longer_than_a_service_name(tiny_model):
    """--health-port serves only grpc.health.v1: a request naming a 64 KiB service is refused on its
    length (gRPC's default bound would read 4 MiB per call, for any caller, with no place to hold);
    a probe is answered SERVING."""
    port = free_port()
    with WorkerProcess(tiny_model, "--health-port", str(port)) as _, \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        exc = refused(lambda: health.Check(health_pb2.HealthCheckRequest(service="x" * 65536), timeout=60))
        assert exc is not None and "larger than max" in exc.details(), exc
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=60).status == health_pb2.HealthCheckResponse.SERVING
