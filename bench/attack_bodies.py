"""Request messages that never end (the hardening issue's F1), each attack beside a victim measured
idle and under attack in the same run, in one table.

The attacker opens calls, each on a connection of its own, through a relay that passes the first
bytes of each connection and then nothing more (the connection stays open): every call sends its
headers and all but the last KiB of its message, and never the rest. A worker holds whatever of
such a message it lets in until the call ends (``--request-read-timeout-s``, 60 s), so what bounds
it is what the worker lets in: a message announcing more than the model's largest valid request is
refused on its length prefix; the others hold a receiving place (``--max-receiving-bytes``) or a
Tokenize or audio place, at most half of them for one client.

- text: the bench model, 20 Generate calls announcing 24 MiB, then ``HELD_CALLS`` Generate calls of
  a valid size (a prompt just under the worker's bound), held together;
- audio: the Whisper fixture (random weights), 20 Generate calls of a 24 MiB WAV and 20 GetModelInfo
  calls announcing 24 MiB, held together (the bound is --max-message-bytes there: audio).

Victim: another tenant's 32-token Generate (a 2-s clip for Whisper), as in ``bench.attack_floods``.
Columns: the victim's TTFT and longest gap idle → worst; the worker's RSS start → peak → end (MiB),
the peak while every call is held; the attackers' statuses by the time all were held or refused
("held": still waiting to send). Goals: victim worst ≤ 3 x idle + 200 ms; RSS growth ≤ 64 MiB;
attackers see only RESOURCE_EXHAUSTED, are held, or (GetModelInfo, answered unread) OK.

    .venv/bin/python -m bench.attack_bodies [--smoke] [--model DIR]
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from bench.attack_floods import CLIP, WHISPER_FIXTURE, MiB, ids_request, whisper_folder
from bench.attack_victim import IDLE_RUNS, Row, Victim, auth, keys_file, report
from bench.fleet import INTRA_OP_THREADS, bench_model, parse_args
from bench.load import RssSampler
from bench.verdict import exit_code
from kvshare.v1 import generator_pb2 as pb
from services.local.worker_process import WorkerProcess

HELD_CALLS = 200
HELD_ALLOWED = {"OK", "RESOURCE_EXHAUSTED", "held"}
"""OK: a GetModelInfo is answered without reading its request (its type has no fields)."""
HOLD_FAILSAFE_S = 120.0  # a failsafe, not a measure: the attack waits for every call's state


class StallingRelay:
    """A TCP relay to ``target`` that passes each connection's first ``limit(n)`` bytes upstream
    (n: the connection's number) and then reads and drops the rest; everything downstream passes.
    ``passed[n]``: bytes passed so far."""

    def __init__(self, target: str, limit) -> None:
        host, port = target.rsplit(":", 1)
        self._upstream, self._limit = (host, int(port)), limit
        self.passed: dict[int, int] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(self.passed)
        self.passed[number] = 0
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)

        async def upstream() -> None:
            while data := await reader.read(65536):
                room = self._limit(number) - self.passed[number]
                if room > 0:
                    up_writer.write(data[:room])
                    self.passed[number] += min(room, len(data))
                    await up_writer.drain()

        async def downstream() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.gather(upstream(), downstream())
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (writer, up_writer):
                w.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)


def held_calls(worker: WorkerProcess, calls: list[tuple[str, bytes]], victim: Victim, name: str) -> Row:
    """``calls`` ((method, serialized request)), each on a connection of its own through a relay
    that stops 1 KiB before its message's end; held until every call is held (its relay stopped) or
    has ended, while ``victim`` runs at least ``IDLE_RUNS`` times."""
    victim.measure_idle(IDLE_RUNS)
    relay = StallingRelay(worker.target, lambda n: len(calls[n][1]) - 1024 if n < len(calls) else 1 << 62)
    channels, futures = [], []
    with RssSampler([worker.pid]) as rss, victim:
        for method, request in calls:
            channel = grpc.insecure_channel(relay.target, options=[("grpc.use_local_subchannel_pool", 1),
                                                                  ("grpc.max_send_message_length", -1)])
            channels.append(channel)
            path = f"/kvshare.v1.Generator/{method}"
            # A streaming call is a future too (done, code, details), whether or not it is read.
            call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path).future
            futures.append(call(request, metadata=auth("attacker"), timeout=HOLD_FAILSAFE_S))
        deadline = time.monotonic() + HOLD_FAILSAFE_S
        while not all(f.done() or relay.passed.get(i, 0) >= len(calls[i][1]) - 1024 for i, f in enumerate(futures)):
            if time.monotonic() > deadline:
                raise RuntimeError("the attack's calls were neither held nor refused in time")
            time.sleep(0.05)
        statuses = [f.code().name if f.done() else "held" for f in futures]
        reasons = Counter(_reason(f.details() or "") for f in futures if f.done() and f.code() != grpc.StatusCode.OK)
        ran = len(victim.runs) + len(victim.failed)
        while len(victim.runs) + len(victim.failed) < ran + IDLE_RUNS:
            time.sleep(0.05)
    for channel in channels:
        channel.close()
    relay.close()
    refused = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()) if why) or "none"
    return Row(name, statuses, HELD_ALLOWED, f"{sum(relay.passed.values()) / MiB:.0f} MiB passed to the worker; "
               f"refused: {refused}", victim.figures(), rss, True)


def _reason(details: str) -> str:
    """Which bound refused a call, from its status details."""
    for words, reason in (("larger than max", "on the length prefix"), ("still arriving", "no receiving place"),
                          ("encoder model", "no audio place"), ("did not arrive within", "read timeout")):
        if words in details:
            return reason
    return f"other ({details[:60]})"


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    big, count, held = (4 * MiB, 4, 20) if args.smoke else (24 * MiB, 20, HELD_CALLS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        common = ("--api-keys-file", str(keys_file(Path(tmp))), "--intra-op-threads", str(INTRA_OP_THREADS))
        with WorkerProcess(model.folder, *common) as worker:
            bound = next(int(line.split("request messages up to ")[1].split()[0])
                         for line in worker.log_lines if "request messages up to " in line)
            prompt = pb.GenerateRequest(prompt="a" * (bound - 4096), max_new_tokens=1).SerializeToString()
            calls = [("Generate", pb.GenerateRequest(prompt="a" * big, max_new_tokens=1).SerializeToString())] * count
            victim = Victim(worker.target, ids_request(np.random.default_rng(1), model.vocab_size, 32))
            rows.append(held_calls(worker, calls + [("Generate", prompt)] * held, victim,
                                   f"text: {count} x Generate of {big / MiB:.0f} MiB, {held} of {bound // 1000} KB "
                                   "(the bound), none ever ending"))
        with WorkerProcess(whisper_folder(Path(tmp)), *common) as worker:
            prompt_ids = json.loads((WHISPER_FIXTURE / "expected.json").read_text())["decoder_prompt_ids"]
            audio = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_new_tokens=2,
                                       encoder_audio=b"\0" * big).SerializeToString()
            info = b"\x0a" + _varint(big) + b"\0" * big  # an unknown field 1 of a GetModelInfoRequest
            victim = Victim(worker.target, lambda _: pb.GenerateRequest(
                prompt_token_ids=prompt_ids, max_new_tokens=32, ignore_eos=True, encoder_audio=CLIP.read_bytes(),
                cache=pb.CacheOptions(skip_read=True, skip_write=True)))
            rows.append(held_calls(worker, [("Generate", audio)] * count + [("GetModelInfo", info)] * count, victim,
                                   f"audio: {count} x Generate of a {big / MiB:.0f} MiB WAV and {count} x "
                                   f"GetModelInfo of {big / MiB:.0f} MiB, none ever ending"))
    met = report(f"Request messages that never end (model {model.name}; audio: the Whisper fixture)", rows, "attack")
    return exit_code(met, args.smoke)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


if __name__ == "__main__":
    sys.exit(main())
