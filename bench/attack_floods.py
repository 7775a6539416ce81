"""Floods against one worker (the hardening issue's attacks), each beside a victim measured idle and
under attack in the same run, in one table:

- tokenize: 100 concurrent ``Tokenize`` calls of 640 KB of text from one tenant
  (``--max-tokenize-requests`` 4 by default, half per client); victim: another tenant's 2-token
  Generate. Twice: on a worker with its derived bound on prompt bytes (which the text may pass),
  and with ``--max-prompt-bytes`` admitting the text, so that each admitted call tokenizes it.
  For both floods of gRPC calls, the refusals' latency p50 / p99 / max (ms, from the call's start)
  is reported beside the same calls refused UNAUTHENTICATED for their key: the floor, which on
  one channel is mostly the client's own sending of every body.
- audio: on the Whisper fixture (tests/fixtures/genai_whisper, random weights: it starts in a
  second), 40 concurrent Generate calls of one tenant, each with a 22 MiB ``encoder_audio`` (a
  valid WAV: ~15 s of 192 kHz stereo float, the densest audio accepted, so an admitted one costs the
  most decoding), beyond ``--max-audio-requests`` 8; victim: another tenant's clip, 32 tokens.
- HTTP floods (``--http-port``), victim a 32-token gRPC stream: 20 chunked (no Content-Length)
  JSON bodies of 32 MiB to /v1/chat/completions (the bytes each connection had sent when the
  answer came are reported: the server's read plus the socket buffers between); 20 bodies of
  4 MiB trickled 64 KiB every 0.25 s (RSS measured a second after they close); one body that
  says ``Content-Encoding: gzip`` and is not gzip.
- burst: ``--max-batch 8 --max-queued 16``, tenants A and B send 250 requests each at once, 30 s
  deadline: each status's count.
- door cost: ``--max-batch 1 --max-queued 1`` with one request running and one queued, bursts of
  100 text Generate calls refused RESOURCE_EXHAUSTED, alternated with the same bursts without a
  valid key, refused UNAUTHENTICATED (the floor: a gRPC call refused before the engine, client and
  server on this machine): refusal p50 / p99 of each, pooled over the rounds.

Victim figures: the median of ``IDLE_RUNS`` runs before the attack ("idle") and the worst run that
overlapped it, for its time to first message (TTFT) and its longest gap between messages, client
side, ms. Worker RSS from /proc every 100 ms: start → peak → end (MiB); in the burst it includes
the slots' K/V memory first touched (not judged there).

Goals (verdict "met" when all of a row's hold): victim worst ≤ 3 x idle + 200 ms; RSS peak growth
≤ 64 MiB for the audio and HTTP floods; attackers get only OK, RESOURCE_EXHAUSTED, INVALID_ARGUMENT,
UNAUTHENTICATED (gRPC) or 400/401/408/413/429/503 (HTTP); the gzip body 400; the burst no
DEADLINE_EXCEEDED, UNKNOWN or INTERNAL; the door's refusal p99 ≤ 1.5 x the floor's, every call refused.

``--smoke``: the tiny model, fewer calls (4 to 40 per flood) and smaller bodies (64 KB to 8 MiB).

    .venv/bin/python -m bench.attack_floods [--smoke] [--model DIR]
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from bench.attack_victim import IDLE_RUNS, KEYS, Row, Victim, auth, counts, keys_file, quantiles, report
from bench.fleet import INTRA_OP_THREADS, bench_model, parse_args
from bench.load import RssSampler
from bench.verdict import exit_code
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.redis_process import free_port
from services.local.traffic import FIRST_TOKEN_ID
from services.local.worker_process import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
WHISPER_FIXTURE = ROOT / "tests" / "fixtures" / "genai_whisper"
CLIP = ROOT / "tests" / "data" / "whisper" / "clip1.wav"
WHISPER_PREPROCESSOR = {  # openai/whisper-tiny.en's preprocessor_config.json (tests/test_log_mel.py)
    "chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "hop_length": 160,
    "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right", "padding_value": 0.0,
    "processor_class": "WhisperProcessor", "return_attention_mask": False, "sampling_rate": 16000}
MiB = 1 << 20
GRPC_ALLOWED = {"OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAUTHENTICATED"}
HTTP_ALLOWED = {"400", "401", "408", "413", "429", "503"}
JSON_BOUND = 4 * MiB
"""services.http.app.MAX_JSON_BYTES: a chat body past it is answered 413."""
PIECE = 64 * 1024
SEND_BUFFER = 64 * 1024  # the flood's sockets keep little in flight, so "sent" is close to "read"
UNLIMITED = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1))


async def at_once(target: str, method: str, requests: list[bytes], metadata, timeout_s: float,
                  options=()) -> list[tuple[str, float]]:
    """``requests`` (serialized) started together on one channel as calls of ``method`` (Generate or
    Tokenize): each one's (status, ms from its start to its end). Serialized once beforehand: a
    client serializing 40 audio bodies of 22 MiB on the event loop (~85 ms each here) would
    otherwise delay every call's answer by all of their serializing."""
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        await channel.channel_ready()
        path = f"/kvshare.v1.Generator/{method}"
        call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)

        async def one(request: bytes) -> tuple[str, float]:
            sent = time.perf_counter()
            try:
                answer = call(request, metadata=metadata, timeout=timeout_s)
                if method == "Generate":
                    async for _ in answer:
                        pass
                else:
                    await answer
                status = "OK"
            except grpc.aio.AioRpcError as err:
                status = err.code().name
            return status, (time.perf_counter() - sent) * 1e3

        return await asyncio.gather(*(one(r) for r in requests))


def refusals(target: str, method: str, requests: list[bytes], results: list[tuple[str, float]]) -> str:
    """The flood's refusals (RESOURCE_EXHAUSTED) p50 / p99 / max, beside the same calls sent without
    a valid key, refused UNAUTHENTICATED before the door: the floor, what a client sending them
    waits for a refusal on this machine whatever the server does (ms)."""
    floor = asyncio.run(at_once(target, method, requests, auth("nobody"), 120, UNLIMITED))
    return ("refusal p50 / p99 / max {:.0f} / {:.0f} / {:.0f} ms; floor (same calls, UNAUTHENTICATED) "
            "{:.0f} / {:.0f} / {:.0f} ms").format(*quantiles([ms for s, ms in results if s == "RESOURCE_EXHAUSTED"]),
                                *quantiles([ms for s, ms in floor if s == "UNAUTHENTICATED"]))


def ids_request(rng: np.random.Generator, vocab: int, new_tokens: int) -> Callable[[int], pb.GenerateRequest]:
    """A fresh random 16-id prompt per run, cache unused: every run computes the same amount."""
    return lambda _: pb.GenerateRequest(prompt_token_ids=rng.integers(FIRST_TOKEN_ID, vocab, 16).tolist(),
                                        max_new_tokens=new_tokens, ignore_eos=True,
                                        cache=pb.CacheOptions(skip_read=True, skip_write=True))


def tokenize_flood(worker: WorkerProcess, vocab: int, calls: int, text_bytes: int, bounds: str) -> Row:
    victim = Victim(worker.target, ids_request(np.random.default_rng(1), vocab, 2))
    victim.measure_idle(IDLE_RUNS)
    text = pb.TokenizeRequest(text=("lorem ipsum " * (text_bytes // 12 + 1))[:text_bytes]).SerializeToString()
    with RssSampler([worker.pid]) as rss, victim:
        results = asyncio.run(at_once(worker.target, "Tokenize", [text] * calls, auth("attacker"), 120, UNLIMITED))
    return Row(f"tokenize: {calls} x Tokenize({text_bytes // 1000} KB text), {bounds}", [s for s, _ in results],
               GRPC_ALLOWED, refusals(worker.target, "Tokenize", [text] * calls, results), victim.figures(), rss)


def wav(frames: np.ndarray, rate: int) -> bytes:
    """32-bit float WAV of ``frames`` (frames x channels)."""
    channels = frames.shape[1]
    data = frames.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * channels * 4, channels * 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def whisper_folder(into: Path) -> Path:
    folder = into / "whisper-audio"
    shutil.copytree(WHISPER_FIXTURE / "whisper-fp32", folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(WHISPER_PREPROCESSOR))
    return folder


def audio_flood(worker: WorkerProcess, calls: int, body_bytes: int) -> Row:
    prompt = json.loads((WHISPER_FIXTURE / "expected.json").read_text())["decoder_prompt_ids"]
    clip = CLIP.read_bytes()
    victim = Victim(worker.target, lambda _: pb.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=32, ignore_eos=True, encoder_audio=clip,
        cache=pb.CacheOptions(skip_read=True, skip_write=True)))
    victim.measure_idle(IDLE_RUNS)
    frames = (body_bytes - 44) // 8
    noise = (np.random.default_rng(2).standard_normal((frames, 2)) * 0.1).astype(np.float32)
    attack = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=2, ignore_eos=True,
                                encoder_audio=wav(noise, 192_000),
                                cache=pb.CacheOptions(skip_read=True, skip_write=True)).SerializeToString()
    del noise
    with RssSampler([worker.pid]) as rss, victim:
        results = asyncio.run(at_once(worker.target, "Generate", [attack] * calls, auth("attacker"), 120, UNLIMITED))
    return Row(f"audio: {calls} x Generate({body_bytes / MiB:.0f} MiB WAV, {frames / 192_000:.0f} s 192 kHz stereo)",
               [s for s, _ in results], GRPC_ALLOWED, refusals(worker.target, "Generate", [attack] * calls, results),
               victim.figures(), rss, True)


@dataclass(slots=True)
class HttpAnswer:
    status: str
    """The answer's status code, or "closed" / "reset" when the connection ended without one."""
    sent: int
    """Body bytes the client had handed to its socket when the answer came (or the connection broke)."""
    message: str = ""


async def read_answer(reader: asyncio.StreamReader) -> tuple[str, str]:
    """(status, the error message of a JSON body) of an HTTP/1.1 answer."""
    try:
        line = await reader.readline()
        if not line:
            return "closed", ""
        length = 0
        while (header := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            length = int(value) if name.strip().lower() == "content-length" else length
        body = await reader.readexactly(min(length, 65536)) if length else b""
    except (ConnectionError, asyncio.IncompleteReadError):
        return "reset", ""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return line.split()[1].decode(), message


async def post(address: str, head: bytes, pieces: Iterable[bytes], interval_s: float = 0.0) -> HttpAnswer:
    """Sends ``head`` then ``pieces`` (``interval_s`` apart), stopping once an answer comes."""
    host, _, port = address.rpartition(":")
    sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host.strip("[]"), int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.transport.set_write_buffer_limits(high=PIECE)
    answer = asyncio.create_task(read_answer(reader))
    sent = 0
    try:
        writer.write(head)
        for piece in pieces:
            if answer.done():
                break
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
            if interval_s:
                await asyncio.wait([answer], timeout=interval_s)
    except ConnectionError:
        pass
    sent -= writer.transport.get_write_buffer_size() if not writer.transport.is_closing() else 0
    status, message = await asyncio.wait_for(answer, 300)
    writer.close()
    return HttpAnswer(status, max(sent, 0), message)


def chat_head(address: str, model: str, headers: dict[str, str]) -> tuple[bytes, bytes, bytes]:
    """(request head, the body's start and end around a message's content) of a chat completion."""
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: {address}", f"Authorization: Bearer {KEYS['attacker']}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    start = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": ""}]})
    before, after = start.rsplit('""', 1)
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), (before + '"').encode(), ('"' + after).encode()


def body_pieces(start: bytes, end: bytes, size: int) -> Iterator[bytes]:
    """A JSON body of ``size`` bytes in pieces of ``PIECE`` (the message's content: ``a``s)."""
    filler, left = b"a" * PIECE, size - len(start) - len(end)
    yield start
    while left > 0:
        yield filler[:left]
        left -= PIECE
    yield end


def chunked(pieces: Iterable[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


def http_floods(worker: WorkerProcess, vocab: int, model: str, sizes: tuple, victim_tokens: int) -> list[Row]:
    """The chunked flood, the trickled flood and the false gzip body, each beside the victim."""
    (chunked_count, chunked_bytes), (slow_count, slow_bytes, slow_interval_s) = sizes
    address = worker.http_target
    victim = Victim(worker.target, ids_request(np.random.default_rng(3), vocab, victim_tokens))
    victim.measure_idle(IDLE_RUNS)

    async def many(count: int, make: Callable[[], Iterable[bytes]], head: bytes, interval_s: float = 0.0):
        return await asyncio.gather(*(post(address, head, make(), interval_s) for _ in range(count)))

    head, start, end = chat_head(address, model, {"Transfer-Encoding": "chunked"})
    with RssSampler([worker.pid]) as rss, victim:
        answers = asyncio.run(many(chunked_count, lambda: chunked(body_pieces(start, end, chunked_bytes)), head))
        time.sleep(1.0)  # the RSS after the bodies are gone (freed pages are handed back on a thread)
    # What the server read cannot be seen from here: what the client had sent when the answer came
    # is that plus what the sockets between held (loopback's receive buffer may grow to tcp_rmem's
    # maximum). Judged: the answer came before the body ended, i.e. the server did not wait for it.
    most = max(a.sent for a in answers)
    rows = [Row(f"HTTP: {chunked_count} chunked {chunked_bytes // MiB} MiB chat bodies", [a.status for a in answers],
                HTTP_ALLOWED, f"sent before the answer: at most {most / MiB:.1f} MiB (the server's read, bound "
                f"{JSON_BOUND // MiB} MiB, plus the sockets' buffers)", victim.figures(), rss, True,
                ["answered after the whole body"] if most >= chunked_bytes else [])]
    head, start, end = chat_head(address, model, {"Content-Length": str(slow_bytes)})
    with RssSampler([worker.pid]) as rss, victim:
        answers = asyncio.run(many(slow_count, lambda: body_pieces(start, end, slow_bytes), head, slow_interval_s))
        time.sleep(1.0)
    seconds = slow_bytes / PIECE * slow_interval_s
    rows.append(Row(f"HTTP: {slow_count} bodies of {slow_bytes / MiB:g} MiB trickled over {seconds:.1f} s",
                    [a.status for a in answers], HTTP_ALLOWED,
                    f"answers: {'; '.join(sorted({a.message[:70] for a in answers}))}", victim.figures(), rss, True))
    not_gzip = b'{"model": "%s", "messages": []}' % model.encode()
    head = chat_head(address, model, {"Content-Encoding": "gzip", "Content-Length": str(len(not_gzip))})[0]
    answer = asyncio.run(post(address, head, [not_gzip]))
    rows.append(Row("HTTP: Content-Encoding gzip, body not gzip", [answer.status], HTTP_ALLOWED,
                    f"answer: {answer.message[:90]}", misses=[] if answer.status == "400" else ["not 400"]))
    return rows


def push_out_burst(worker: WorkerProcess, vocab: int, per_tenant: int, new_tokens: int) -> Row:
    rng = np.random.default_rng(4)
    requests = [pb.GenerateRequest(prompt_token_ids=rng.integers(FIRST_TOKEN_ID, vocab, 32).tolist(),
                                   max_new_tokens=new_tokens, ignore_eos=True).SerializeToString()
                for _ in range(2 * per_tenant)]

    async def both() -> list[list[tuple[str, float]]]:
        return await asyncio.gather(*(at_once(worker.target, "Generate", requests[k * per_tenant:(k + 1) * per_tenant],
                                              auth(t), 30) for k, t in enumerate(("a", "b"))))

    with RssSampler([worker.pid]) as rss:
        a, b = asyncio.run(both())
    # Judged by the statuses allowed, which leave out DEADLINE_EXCEEDED, UNKNOWN and INTERNAL.
    return Row(f"burst: tenants A and B, {per_tenant} requests each at once, 30 s deadline",
               [s for s, _ in a + b], GRPC_ALLOWED, f"A: {counts(s for s, _ in a)}; B: {counts(s for s, _ in b)}", rss=rss)


def drain(call) -> None:
    """Reads a stream to its end, or to its cancellation."""
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass


def door_cost(worker: WorkerProcess, count: int, rounds: int, words: int) -> Row:
    """Bursts refused at a full door beside the same bursts refused for their key (the floor)."""
    prompt = " ".join(f"word{i}" for i in range(words))
    burst = [pb.GenerateRequest(prompt=f"{i} {prompt}", max_new_tokens=4, ignore_eos=True).SerializeToString()
             for i in range(count)]
    with grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        context = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth("a")).context_length
        hold = pb.GenerateRequest(prompt_token_ids=[5] * 16, max_new_tokens=context - 16, ignore_eos=True)
        running = stub.Generate(hold, metadata=auth("a"), timeout=600)
        next(running)  # running: it holds the one slot (read on, so that it never pauses for its reader)
        queued = stub.Generate(hold, metadata=auth("b"), timeout=600)
        for call in (running, queued):
            threading.Thread(target=drain, args=(call,), daemon=True).start()
        time.sleep(1.0)  # the queued call is past the door and holds the one place in the queue
        door, floor, statuses = [], [], []
        with RssSampler([worker.pid]) as rss:
            for _ in range(rounds):
                for tenant, into in (("c", door), ("nobody", floor)):
                    results = asyncio.run(at_once(worker.target, "Generate", burst, auth(tenant), 120))
                    into.extend(ms for s, ms in results if s in ("RESOURCE_EXHAUSTED", "UNAUTHENTICATED"))
                    if tenant == "c":
                        statuses.extend(s for s, _ in results)
        running.cancel()
        queued.cancel()
    (d50, d99, _), (f50, f99, _) = quantiles(door), quantiles(floor)
    served = count * rounds - len(door)
    misses = [f"p99 {d99 / f99:.1f}x the floor's"] if d99 > 1.5 * f99 else []
    misses += [f"{served} not refused"] if served else []
    return Row(f"door cost: {rounds} x {count} text Generate calls, one running and one queued",
               statuses, GRPC_ALLOWED, f"refusal p50 / p99 {d50:.0f} / {d99:.0f} ms; floor (UNAUTHENTICATED) "
               f"{f50:.0f} / {f99:.0f} ms; not refused: {served}", rss=rss, misses=misses)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    smoke = args.smoke
    tokenize = (10, 64_000) if smoke else (100, 640_000)
    audio = (10, 4 * MiB) if smoke else (40, 22 * MiB)
    http = ((4, 8 * MiB), (4, MiB // 2, 0.02)) if smoke else ((20, 32 * MiB), (20, 4 * MiB, 0.25))
    burst_size, door_size, door_rounds = (40, 20, 1) if smoke else (250, 100, 3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        common = ("--api-keys-file", str(keys_file(Path(tmp))), "--intra-op-threads", str(INTRA_OP_THREADS))
        # Twice: with the worker's own bound on prompt bytes (derived from the context: the text may
        # be refused for its size alone) and with one that admits the text, so that it is tokenized.
        for bounds in ((), ("--max-prompt-bytes", str(tokenize[1]))):
            worker = stack.enter_context(WorkerProcess(model.folder, *common, *bounds))
            rows.append(tokenize_flood(worker, model.vocab_size, *tokenize, " ".join(bounds) or "default bounds"))
            stack.close()
        worker = stack.enter_context(WorkerProcess(whisper_folder(Path(tmp)), *common))
        rows.append(audio_flood(worker, *audio))
        stack.close()
        worker = stack.enter_context(WorkerProcess(model.folder, *common, "--http-port", str(free_port())))
        with grpc.insecure_channel(worker.target) as channel:  # the name the HTTP face serves the model by
            name = pb_grpc.GeneratorStub(channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=auth("victim")).name
        rows.extend(http_floods(worker, model.vocab_size, name, http, 8 if smoke else 32))
        stack.close()
        worker = stack.enter_context(WorkerProcess(model.folder, *common, "--max-batch", "8", "--max-queued", "16"))
        rows.append(push_out_burst(worker, model.vocab_size, burst_size, 4 if smoke else 16))
        stack.close()
        worker = stack.enter_context(WorkerProcess(model.folder, *common, "--max-batch", "1", "--max-queued", "1"))
        rows.append(door_cost(worker, door_size, door_rounds, 40 if smoke else 300))
    held = report(f"Floods against one worker (model {model.name}; audio: the Whisper fixture)", rows, "flood")
    return exit_code(held, smoke)


if __name__ == "__main__":
    sys.exit(main())
