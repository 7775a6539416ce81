"""The HTTP face under bad input, missing keys, a full worker and clients that leave: every
refusal is OpenAI's error object with the status the ``openai`` client turns into its own
exception, never a 500, and the server serves on. Real worker processes on the tiny model; each
wait is for a state (a log line, a metrics gauge), never for a duration."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from conftest import wait_until
from test_route import LOG_TIMEOUT_S, running

from kvshare.v1 import generator_pb2 as pb
from services.api.api_keys import key_line
from services.http.upstream import Caller, Upstream
from services.local.redis_process import free_port
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess

KEY = "sk-test-key-0123456789"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
LIMIT = 65536
"""The worker's --max-message-bytes: the largest HTTP body too."""


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(key_line("tenant-a", KEY))
    with WorkerProcess(tiny_model, "--api-keys-file", str(keys), "--http-port", str(free_port()),
                       "--max-message-bytes", str(LIMIT)) as w:
        yield w


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_target}/v1", api_key=key, max_retries=0, timeout=60)


def model_of(server) -> str:
    return client(server).models.list().data[0].id


def test_missing_and_wrong_keys_are_authentication_errors(worker):
    with pytest.raises(openai.AuthenticationError) as info:
        client(worker, "sk-wrong").completions.create(model=model_of(worker), prompt="x", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(worker, "sk-wrong").models.list()
    base = f"http://{worker.http_target}/v1"
    for method, path, body in (("GET", "/models", None), ("POST", "/completions", b'{"prompt": "x"}')):
        status, reply = send(method, base + path, body, key=None)
        assert status == 401 and reply["error"]["type"] == "authentication_error", reply
    assert client(worker).completions.create(model=model_of(worker), prompt="x", max_tokens=2).usage.completion_tokens


def test_bad_parameters_are_bad_request_errors_naming_the_parameter(worker):
    model = model_of(worker)
    cases = {
        "temperature": dict(prompt="x", temperature=3),
        "max_tokens": dict(prompt="x", max_tokens=100_000),  # the worker's cap, renamed from max_new_tokens
        "top_p": dict(prompt="x", top_p=0),
        "suffix": dict(prompt="x", suffix="y"),
        "prompt": dict(prompt=[]),
        "logprobs": dict(prompt="x", logprobs=99),
        "stop[0]": dict(prompt="x", stop=[""]),
    }
    for param, fields in cases.items():
        with pytest.raises(openai.BadRequestError) as info:
            client(worker).completions.create(model=model, **fields)
        assert info.value.body["param"] == param, (param, info.value.body)
        assert info.value.body["message"].startswith(f"{param}: "), info.value.body
    with pytest.raises(openai.NotFoundError) as info:
        client(worker).completions.create(model="gpt-4o", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    # The tiny model has no chat template and takes no audio: each face says where to go instead.
    with pytest.raises(openai.BadRequestError) as info:
        client(worker).chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["param"] == "messages" and "/v1/completions" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client(worker).audio.transcriptions.create(model=model, file=("a.wav", b"RIFF"))
    assert info.value.body["param"] == "model" and "takes no audio" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client(worker).completions.create(model=model, prompt="x", max_tokens=0)
    assert "leave it out" in info.value.body["message"]


def send(method: str, url: str, body: bytes | None, key: str | None = KEY, content_type: str = "application/json"
         ) -> tuple[int, dict]:
    """A raw request (with ``key``; None: no Authorization header): its status and JSON body."""
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


MALFORMED = {
    "not JSON": b"{not json",
    "empty": b"",
    "an array": b"[]",
    "null": b"null",
    "not UTF-8": b"\xff\xfe{}",
    "deep nesting": b"[" * 30_000 + b"]" * 30_000,
    "messages not a list": json.dumps({"messages": "hi"}).encode(),
    "messages empty": json.dumps({"messages": []}).encode(),
    "a message not an object": json.dumps({"messages": ["hi"]}).encode(),
    "unknown role": json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
    "content a number": json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
    "an image part": json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    "max_tokens a string": json.dumps({**CHAT, "max_tokens": "ten"}).encode(),
    "max_tokens huge": b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    "temperature NaN": b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    "n zero": json.dumps({**CHAT, "n": 0}).encode(),
    "stop a number": json.dumps({**CHAT, "stop": [1]}).encode(),
    "tools": json.dumps({**CHAT, "tools": [{"type": "function"}]}).encode(),
    "stream_options without stream": json.dumps({**CHAT, "stream_options": {"include_usage": True}}).encode(),
    "top_logprobs without logprobs": json.dumps({**CHAT, "top_logprobs": 2}).encode(),
    "seed a float": json.dumps({**CHAT, "seed": 1.5}).encode(),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_bodies_get_400_and_the_server_serves_on(worker, case):
    url = f"http://{worker.http_target}/v1/chat/completions"
    status, reply = send("POST", url, MALFORMED[case])
    assert status == 400, (case, status, reply)
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["message"], case


NAMED = {
    "a role that is an array": ("chat/completions", {"messages": [{"role": ["user"], "content": "x"}]},
                                "messages[0].role"),
    "content with an unpaired surrogate": ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
                                           "messages[0].content"),
    "a text part with an unpaired surrogate": (
        "chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
        "messages[0].content[0].text"),
    "a stop string with an unpaired surrogate": ("chat/completions", {**CHAT, "stop": ["ok", "\ud800"]}, "stop[1]"),
    "cache_salt with an unpaired surrogate": ("chat/completions", {**CHAT, "cache_salt": "\ud800"}, "cache_salt"),
    "a prompt with an unpaired surrogate": ("completions", {"prompt": "x\udfff"}, "prompt"),
    "top_k beyond uint32": ("chat/completions", {**CHAT, "top_k": 2**40}, "top_k"),
    "a stop token id beyond int32": ("chat/completions", {**CHAT, "stop_token_ids": [2**40]}, "stop_token_ids[0]"),
    "temperature an integer beyond every float": ("chat/completions", {**CHAT, "temperature": 10**400}, "temperature"),
    "a prompt token id beyond int32": ("completions", {"prompt": [1, 2**40]}, "prompt[1]"),
    "token ids mixed with an array": ("completions", {"prompt": [1, [2]]}, "prompt"),
    "an empty token-id prompt": ("completions", {"prompt": [[]]}, "prompt"),
}
"""Bodies the HTTP face refuses itself (each was a 500: protobuf or Python refused the value): the
path under /v1, the body, and the parameter the 400 names."""


@pytest.mark.parametrize("case", sorted(NAMED))
def test_values_protobuf_cannot_hold_are_bad_requests_naming_the_field(worker, case):
    path, body, param = NAMED[case]
    status, reply = send("POST", f"http://{worker.http_target}/v1/{path}", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == param, (case, status, reply)


def test_several_token_id_prompts_are_answered_as_each_alone(worker):
    model, ids = model_of(worker), [[5, 6, 7], [8, 9]]
    both = client(worker).completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    alone = [client(worker).completions.create(model=model, prompt=p, max_tokens=3, temperature=0) for p in ids]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]


def test_an_authorization_gRPC_cannot_carry_is_a_missing_key(worker):
    """Non-ASCII bytes in Authorization (as UTF-8 and as Latin-1) are no key: 401, never a 500."""
    url = f"http://{worker.http_target}/v1/completions"
    for value in ("Bearer \u00e9t\u00e9".encode(), b"Bearer \xff" + KEY.encode()):
        request = urllib.request.Request(url, data=b'{"prompt": "x"}', method="POST",
                                         headers={"Content-Type": "application/json", "Authorization": value})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=60)
        reply = json.loads(info.value.read())
        assert info.value.code == 401 and reply["error"]["type"] == "authentication_error", (value, reply)


def test_oversized_bodies_wrong_paths_and_methods_get_json_errors(worker):
    base = f"http://{worker.http_target}"
    multipart = "multipart/form-data; boundary=b"
    for method, path, body, kind, status in (
            ("POST", "/v1/completions", b"x" * (LIMIT + 1), "application/json", 413),
            ("POST", "/v1/audio/transcriptions", b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"'
             b"\r\n\r\n" + b"x" * (4 * LIMIT) + b"\r\n--b--\r\n", multipart, 413),
            ("POST", "/v1/audio/transcriptions", b"--b\r\n" + b"x" * (LIMIT // 2), multipart, 400),
            ("POST", "/v1/audio/transcriptions", b"--b\r\nnot a part", multipart, 400),
            ("POST", "/v1/audio/transcriptions", b'{"file": "x"}', "application/json", 400),
            # A part's unknown charset, an unknown Content-Transfer-Encoding: aiohttp's LookupError, RuntimeError.
            ("POST", "/v1/audio/transcriptions", b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n'
             b"Content-Type: text/plain; charset=no-such-charset\r\n\r\nhi\r\n--b--\r\n", multipart, 400),
            ("POST", "/v1/audio/transcriptions", b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"'
             b"\r\nContent-Transfer-Encoding: x-unknown\r\n\r\nRIFF\r\n--b--\r\n", multipart, 400),
            ("GET", "/v1/chat/completions", None, "application/json", 405),
            ("POST", "/v1/nothing-here", b"{}", "application/json", 404)):
        got, reply = send(method, base + path, body, content_type=kind)
        assert got == status, (path, reply)
        assert reply["error"]["message"], path
    assert send("GET", base + "/health", None) == (200, {"status": "ok"})
    assert client(worker).completions.create(model=model_of(worker), prompt="x", max_tokens=2).choices


HELD_PROMPT = "hold the slot while the store does not answer " * 20
"""Several full blocks: its lookup reads the store (a prompt shorter than a block never does)."""


@pytest.fixture(scope="module")
def stuck_worker(tiny_model):
    """One slot, no queue, and a store that accepts connections and never answers: a request sits
    in its cache lookup, holding the slot, for 2 x 8 s (the store's deadline and its one retry;
    as test_route's stuck fleet), far beyond what the test's next steps take."""
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(128)
        metrics = free_port()
        with WorkerProcess(tiny_model, "--cache", f"redis://127.0.0.1:{blackhole.getsockname()[1]}/0",
                           "--cache-op-timeout-ms", "8000", "--cache-connect-timeout-ms", "8000",
                           "--breaker-failures", "1000000", "--max-batch", "1", "--max-queued", "0",
                           "--metrics-port", str(metrics), "--http-port", str(free_port()),
                           startup_timeout_s=120) as w:
            yield w, metrics


def test_a_full_worker_is_a_rate_limit_error_and_a_client_that_leaves_frees_its_slot(stuck_worker):
    worker, metrics = stuck_worker
    model = model_of(worker)
    host, port = worker.http_target.rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": HELD_PROMPT, "max_tokens": 400, "stream": True}).encode()
    held = socket.create_connection((host, int(port)), timeout=60)
    held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvshare\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:
        wait_until(lambda: running(metrics) == 1, LOG_TIMEOUT_S, "the held request to take the only slot")
        with pytest.raises(openai.RateLimitError) as info:
            client(worker).completions.create(model=model, prompt="one more", max_tokens=2)
        assert info.value.response.headers["Retry-After"] == "1"
        assert info.value.body["type"] == "rate_limit_error"
    finally:
        held.shutdown(socket.SHUT_RDWR)  # the client leaves, its request still in the worker's cache lookup
        held.close()
    wait_until(lambda: running(metrics) == 0, LOG_TIMEOUT_S, "the worker to free the slot of a client that left")
    wait_until(lambda: any("request cmpl-" in line and "stopped after 0 generated tokens" in line
                           for line in worker.log_lines), LOG_TIMEOUT_S, "the worker's line for the cancelled request")



UNREAD_ROWS = 8
"""Samples of the stream nobody reads: 8 x 1000 tokens with 20 alternatives each are megabytes of
messages, far past the 64 KiB window a stream of the face's channel keeps."""


def test_the_faces_channel_leaves_an_unread_stream_paused_at_the_worker(tiny_model):
    """The HTTP face's gRPC channel (``Upstream``) holds no more of a stream than its window: once
    an HTTP client stops reading, the worker's rows pause, and end after --max-paused-s, every
    sample as ABORT; none runs on to its max_new_tokens into a window grown to fit it."""
    metrics = free_port()
    with WorkerProcess(tiny_model, "--max-batch", str(UNREAD_ROWS), "--max-unread-tokens", "8", "--max-paused-s", "1",
                       "--metrics-port", str(metrics)) as worker:
        async def read_late() -> list[pb.GenerateResponse]:
            upstream = Upstream(worker.target, LIMIT)
            try:
                call = upstream.generate(pb.GenerateRequest(prompt="hello", max_new_tokens=1000, ignore_eos=True,
                                                            n=UNREAD_ROWS, logprobs=True, top_logprobs=20),
                                         Caller((), None))
                answer = [await call.read()]  # the rows hold their slots
                await asyncio.to_thread(wait_until, lambda: running(metrics) == 0, LOG_TIMEOUT_S,
                                        "the unread stream's rows to end")
                while (message := await call.read()) is not grpc.aio.EOF:
                    answer.append(message)
                return answer
            finally:
                await upstream.close()

        answer = asyncio.run(read_late())
    finished = [message.finish_reason for message in answer if message.finish_reason]
    assert finished == [pb.FINISH_REASON_ABORT] * UNREAD_ROWS, finished


def test_a_body_of_unknown_length_waits_for_the_key_and_an_announced_oversize_is_refused_unread(worker):
    """Nobody without a key makes the server read a body that may be big: a chunked one (no
    Content-Length) is answered 401 before it is read, and one announced over the limit 413
    before a byte of it is sent."""
    host, port = worker.http_target.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", body=iter([b'{"prompt": "x", "max_tokens": 2}']),
                       headers={"Content-Type": "application/json"}, encode_chunked=True)
    reply = connection.getresponse()
    assert reply.status == 401 and json.loads(reply.read())["error"]["type"] == "authentication_error"
    connection.close()
    with socket.create_connection((host, int(port)), timeout=60) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvshare\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (100 * LIMIT))
        head = raw.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_a_requests_calls_share_one_deadline():
    """--http-timeout-s bounds the whole request: each call it makes (the echo's Tokenize calls,
    then Generate) gets what is left of one deadline, not the whole timeout again."""
    assert Caller.from_headers(None, 0).timeout_s is None
    assert 0 < Caller.from_headers(None, 30).timeout_s <= 30
    assert Caller((), time.monotonic() - 1).timeout_s == 0


def test_a_prompt_longer_than_any_valid_request_is_413_not_a_rate_limit(tiny_model):
    """The tiny model's worker reads no gRPC message longer than its largest valid request
    (~170 KB): a 1 MB prompt, within the HTTP face's 4 MiB JSON bound, is refused on its length by
    gRPC's RESOURCE_EXHAUSTED, which here is a 413 naming the sizes, never a 429 (a client retries a
    429, and no retry of this request can succeed); the server serves on."""
    with WorkerProcess(tiny_model, "--http-port", str(free_port())) as worker:
        face = client(worker)
        with pytest.raises(openai.APIStatusError) as info:
            face.completions.create(model=model_of(worker), max_tokens=2, prompt="a" * 1_000_000)
        assert info.value.status_code == 413, info.value
        assert info.value.body["code"] == "request_too_large" and "bytes" in info.value.body["message"]
        assert face.completions.create(model=model_of(worker), prompt="hello", max_tokens=2).choices[0].text is not None
