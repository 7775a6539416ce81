"""What the HTTP face may be made to hold, and for how long, whatever a client sends: each JSON
body at most 4 MiB however it is framed (chunked, compressed), all bodies in flight together at
most --http-max-buffered-bytes, at most --http-max-connections open, a request's head within
--http-header-timeout-s and its body within --http-body-timeout-s; and a request aiohttp cannot
parse is a 400 and one log line, never a traceback.

The bounds are counted where they are kept: an ``HttpFace`` started here, in front of a real
worker process over gRPC, whose body budget (``bodies``) and connection gate (``gate``) the tests
read; the flags are tested through worker processes. Every wait is for a state (a count, a log
line, a closed socket), never for a duration."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
from conftest import wait_until
from test_route import LOG_TIMEOUT_S

from services.api.api_keys import key_line
from services.http.app import MAX_JSON_BYTES, HttpFace
from services.http.limits import HttpLimits
from services.http.upstream import Upstream
from services.local.redis_process import free_port
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess

KEY = "sk-test-key-0123456789"
LIMITS = HttpLimits(timeout_s=0, max_body_bytes=32 << 20, max_connections=512, max_buffered_bytes=64 << 20,
                    header_timeout_s=10, body_timeout_s=60)
"""The worker's defaults; each test changes what it tests."""
PIECE = 64 * 1024


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(key_line("tenant-a", KEY))
    with WorkerProcess(tiny_model, "--api-keys-file", str(keys), "--http-port", str(free_port())) as w:
        yield w


@pytest.fixture(scope="module")
def impatient(tiny_model):
    """A worker whose HTTP face waits 1 s for a request's head and 1 s for its body."""
    with WorkerProcess(tiny_model, "--http-port", str(free_port()), "--http-header-timeout-s", "1",
                       "--http-body-timeout-s", "1") as w:
        yield w


@asynccontextmanager
async def face(worker, **limits) -> AsyncIterator[tuple[HttpFace, int]]:
    """An HTTP face on a free loopback port in front of ``worker``'s gRPC port: (face, port)."""
    http = HttpFace(Upstream(worker.target, LIMITS.max_body_bytes), replace(LIMITS, **limits))
    port = await http.start("127.0.0.1", 0, None)
    try:
        yield http, port
    finally:
        await http.stop()


def head(path: str, *headers: str, key: str | None = KEY) -> bytes:
    kind = "multipart/form-data; boundary=b" if path.endswith("/transcriptions") else "application/json"
    lines = [f"POST {path} HTTP/1.1", "Host: kvshare", f"Content-Type: {kind}", *headers]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], dict]:
    """One HTTP response with a JSON body: (status, headers, body)."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    body = await reader.readexactly(int(headers["Content-Length"]))
    return int(lines[0].split()[1]), headers, json.loads(body)


async def until(predicate, what: str) -> None:
    deadline = time.monotonic() + LOG_TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def refused_while_sending(port: int, request_head: bytes, pieces) -> tuple[int, dict]:
    """Sends ``request_head`` then ``pieces`` until the server answers; its status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        writer.write(request_head)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()

    sending = asyncio.create_task(send())
    try:
        status, _, body = await answer(reader)
    finally:
        sending.cancel()
        writer.transport.abort()
    return status, body


@pytest.mark.parametrize("framing", ["chunked", "gzip"])
def test_a_json_body_is_refused_at_4_MiB_however_framed_having_held_at_most_that(worker, framing):
    """A chunked body of 16 MiB and a gzip body that decodes to 64 MiB (its Content-Length says
    64 KB): both 413 once the decoded bytes would pass 4 MiB; the face never held more."""
    async def scenario() -> None:
        async with face(worker) as (http, port):
            if framing == "chunked":
                pieces = (chunk(b" " * PIECE) for _ in range((16 << 20) // PIECE))
                request_head = head("/v1/completions", "Transfer-Encoding: chunked")
            else:  # 64 MiB of JSON whitespace, then {}: about 64 KB gzip'd
                bomb = gzip.compress(b" " * (64 << 20) + b"{}", compresslevel=9)
                pieces = [bomb]
                request_head = head("/v1/completions", "Content-Encoding: gzip", f"Content-Length: {len(bomb)}")
            status, body = await refused_while_sending(port, request_head, pieces)
            assert status == 413 and body["error"]["code"] == "request_too_large", body
            assert f"{MAX_JSON_BYTES} bytes (JSON bodies)" in body["error"]["message"]
            assert 0 < http.bodies.peak <= MAX_JSON_BYTES, http.bodies.peak
            assert http.bodies.held == 0

    asyncio.run(scenario())


def test_bodies_in_flight_share_one_budget_given_back_however_they_end(worker):
    """With --http-max-buffered-bytes 1 MiB: a request whose body would pass what others hold gets
    503 with Retry-After, and is served once they are done; a client that leaves mid-body gives
    its bytes back; one body over the budget alone is a 413 naming the flag."""
    budget, held_part = 1 << 20, 768 << 10
    prefix = b'{"max_tokens": 1, "prompt": "'

    async def hold(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head("/v1/completions", "Transfer-Encoding: chunked"))
        writer.write(chunk(prefix + b"a" * (held_part - len(prefix))))
        await writer.drain()
        return reader, writer

    async def post(port: int, size: int) -> tuple[int, dict[str, str], dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = prefix + b"b" * (size - len(prefix) - 2) + b'"}'
        writer.write(head("/v1/completions", f"Content-Length: {len(body)}") + body)
        try:
            return await answer(reader)
        finally:
            writer.close()

    async def scenario() -> None:
        async with face(worker, max_buffered_bytes=budget) as (http, port):
            reader, writer = await hold(port)
            await until(lambda: http.bodies.held >= held_part, "the held body to be read")
            status, headers, body = await post(port, 512 << 10)
            assert status == 503 and headers["Retry-After"] == "1", body
            assert body["error"]["type"] == "service_unavailable"
            assert "--http-max-buffered-bytes" in body["error"]["message"]
            writer.write(chunk(b'"}') + b"0\r\n\r\n")
            status, _, body = await answer(reader)
            assert status != 503, body  # served (the worker refuses the tiny model's over-long prompt)
            writer.close()
            assert http.bodies.held == 0
            status, _, body = await post(port, 512 << 10)
            assert status != 503, body

            _, leaving = await hold(port)
            await until(lambda: http.bodies.held >= held_part, "the second held body to be read")
            leaving.transport.abort()
            await until(lambda: http.bodies.held == 0, "the bytes of a client that left to be given back")

            for framing in ("length", "chunked"):
                if framing == "length":
                    status, _, body = await post(port, budget + 1)
                else:
                    status, body = await refused_while_sending(
                        port, head("/v1/completions", "Transfer-Encoding: chunked"),
                        (chunk(b" " * PIECE) for _ in range(2 * budget // PIECE)))
                assert status == 413 and "--http-max-buffered-bytes" in body["error"]["message"], (framing, body)
            assert http.bodies.peak <= budget

    asyncio.run(scenario())


def test_connections_past_the_limit_take_an_idle_ones_place_or_are_answered_503_at_once(worker):
    """At the limit, a new connection closes the one idle longest (no request begun: a silent
    client) and takes its place; with every connection inside a request's head, it is answered 503
    and closed at once. 512 silent connections shut everyone out for their 75 s of idle before."""
    begun = b"GET /health HTTP/1.1\r\n"  # a head begun, not finished: that connection is not idle

    async def scenario() -> None:
        async with face(worker, max_connections=2, header_timeout_s=600) as (http, port):
            first, second = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await until(lambda: http.gate.open == 2, "both connections to be open")
            for _, writer in (first, second):
                writer.write(begun)
            await until(lambda: not http.gate._idle, "both heads to arrive")  # noqa: SLF001
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            status, headers, body = await answer(reader)
            assert status == 503 and headers["Retry-After"] == "1" and headers["Connection"] == "close", body
            assert "--http-max-connections" in body["error"]["message"]
            assert await reader.read() == b""  # closed: nothing queued
            writer.close()
            assert (http.gate.open, http.gate.refused, http.gate.evicted) == (2, 1, 0)
            first[1].close()
            await until(lambda: http.gate.open == 1, "the closed connection to be counted out")
            silent = await asyncio.open_connection("127.0.0.1", port)
            await until(lambda: http.gate.open == 2, "the silent connection to be open")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: kvshare\r\n\r\n")
            status, _, body = await answer(reader)
            assert (status, body) == (200, {"status": "ok"})
            assert await silent[0].read() == b"", "the silent connection was closed for the new one"
            assert (http.gate.open, http.gate.refused, http.gate.evicted) == (2, 1, 1)
            writer.close()
            second[1].close()

    asyncio.run(scenario())


def raw_exchange(server, data: bytes) -> bytes:
    """Sends ``data`` on a fresh connection; the server's answer (head and body), read whole."""
    host, port = server.http_target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=LOG_TIMEOUT_S) as sock:
        sock.sendall(data)
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        answer_head, _, body = received.partition(b"\r\n\r\n")
        length = int(next(line for line in answer_head.split(b"\r\n") if line.startswith(b"Content-Length: "))[16:])
        while len(body) < length:
            body += sock.recv(65536)
    return received[:len(answer_head) + 4] + body


def test_bodies_that_do_not_decode_are_400_naming_the_encoding(worker):
    """gzip that is not gzip (a 500 before, with or without a key: now a compressed body waits for
    the key, as any that may be big), and an encoding aiohttp does not decode (read before as if it
    were not encoded); a real gzip body is served."""
    garbage = b"this is not gzip at all"
    for path in ("/v1/completions", "/v1/audio/transcriptions"):
        for key, status, words in ((None, b"401", "Authorization"), (KEY, b"400", "Content-Encoding 'gzip'")):
            reply = raw_exchange(worker, head(path, "Content-Encoding: gzip", f"Content-Length: {len(garbage)}",
                                              "Connection: close", key=key) + garbage)
            assert reply.split(b" ")[1] == status, (path, key, reply[:300])
            assert words in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"], reply[:300]
    reply = raw_exchange(worker, head("/v1/completions", "Content-Encoding: x-squash", "Content-Length: 2",
                                      "Connection: close") + b"{}")
    assert reply.startswith(b"HTTP/1.1 400") and b"'x-squash' is not supported" in reply, reply[:300]
    packed = gzip.compress(json.dumps({"prompt": "hello", "max_tokens": 2}).encode())
    reply = raw_exchange(worker, head("/v1/completions", "Content-Encoding: gzip", f"Content-Length: {len(packed)}",
                                      "Connection: close") + packed)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert not [line for line in worker.log_lines if line.startswith("Traceback")]


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (read EOF or a reset), waiting at most LOG_TIMEOUT_S."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_head_that_never_completes_is_cut_at_the_header_timeout(impatient):
    host, port = impatient.http_target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=LOG_TIMEOUT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: kvshare\r\n")
        assert closed_by_server(sock)
    # Trickled: bytes that keep coming do not hold the deadline off.
    with socket.create_connection((host, int(port)), timeout=LOG_TIMEOUT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: kvshare\r\nX-Pad: ")
        deadline = time.monotonic() + LOG_TIMEOUT_S
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while time.monotonic() < deadline:
                sock.sendall(b"a")
                time.sleep(0.02)


def test_a_body_that_stops_arriving_is_a_408(impatient):
    reply = raw_exchange(impatient, head("/v1/completions", "Content-Length: 100", key=None) + b'{"prompt"')
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"--http-body-timeout-s" in reply


MALFORMED_FRAMING = {
    "a request line that is not HTTP": b"GARBAGE\r\n\r\n",
    "a header name with a control byte": b"GET /health HTTP/1.1\r\nHost: kvshare\r\nBad\x01Name: x\r\n\r\n",
    "a chunk size that is not hex": head("/v1/completions", "Transfer-Encoding: chunked", key=None) + b"ZZZ\r\nabc\r\n",
    "a Content-Length that is not a number": head("/v1/completions", "Content-Length: 1e3", key=None) + b"{}",
}


def test_malformed_requests_and_clients_that_leave_log_one_line_and_no_traceback(impatient):
    for case, data in MALFORMED_FRAMING.items():
        assert raw_exchange(impatient, data).split(b"\r\n", 1)[0] in (b"HTTP/1.0 400 Bad Request",
                                                                       b"HTTP/1.1 400 Bad Request"), case
    host, port = impatient.http_target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=LOG_TIMEOUT_S) as sock:  # leaves mid-body
        sock.sendall(head("/v1/completions", "Content-Length: 1000", key=None) + b'{"prompt"')
    stream = json.dumps({"prompt": "hello", "max_tokens": 200, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=LOG_TIMEOUT_S) as sock:  # leaves mid-stream
        sock.sendall(head("/v1/completions", f"Content-Length: {len(stream)}", key=None) + stream)
        assert sock.recv(15) == b"HTTP/1.1 200 OK"
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closes with a reset
    # A request logged after all of the above: once its line is in, so is anything they logged.
    done = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    reply = raw_exchange(impatient, head("/v1/completions", f"Content-Length: {len(done)}", "Connection: close",
                                         key=None) + done)
    request_id = json.loads(reply.partition(b"\r\n\r\n")[2])["id"]
    wait_until(lambda: any(f"request {request_id} " in line for line in impatient.log_lines), LOG_TIMEOUT_S,
               "the last request's log line")
    refused = [line for line in impatient.log_lines if "refused a malformed HTTP request" in line]
    # One line (the rest within 10 s held back; a first request that is not HTTP is a DEBUG line).
    assert len(refused) == 1 and "Invalid" in refused[0], refused
    assert not [line for line in impatient.log_lines if line.startswith("Traceback")], impatient.log_lines[-40:]
