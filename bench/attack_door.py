"""Attacks on a worker's door through the public gRPC API (issue 33's findings 1, 2 and 5a), each
against one worker process with two tenants (API keys), on the bench model:

- tokenize: four ``Tokenize(token_ids=[3] * 4_100_000)`` calls in parallel beside a stream of
  ``STREAM_TOKENS`` tokens: the stream's longest gap between messages, the calls' outcome, and the
  worker's resident memory before and at its peak.
- hoard: ``--max-batch 8 --max-queued 16 --max-paused-s 10``; one tenant opens 24 streams over 24
  channels, each asking 1,900 tokens with 20 top log-probabilities, and never reads them; then the
  other tenant sends 6 requests one after another: how many are served, and the slowest one's time
  to its first token. Twice: with the hoarder's HTTP/2 windows kept at 64 KiB
  (``grpc.http2.bdp_probe=0``: its streams soon pause) and with gRPC's default flow control
  (windows grow to megabytes: its streams run on unread).
- burst: 500 requests with a text prompt of 300 words (~2,000 characters) at once to the same worker
  configuration: how many are refused and how long each refusal took (p50 / p99 / max, from the
  call's start), against the door's promise of 50 ms p99 (``bench.load.REFUSAL_P99_MS``), and the
  same burst without an API key, refused UNAUTHENTICATED before the engine: what a refusal costs
  in gRPC alone, client and server on this machine.

    .venv/bin/python -m bench.attack_door [--smoke] [--model DIR]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np

from bench.attack_victim import KEYS, auth, keys_file
from bench.fleet import INTRA_OP_THREADS, bench_model, parse_args, print_table
from bench.load import REFUSAL_P99_MS, RssSampler
from bench.verdict import exit_code
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.worker_process import WorkerProcess

STREAM_TOKENS = 1500
HOARD_ARGS = ("--max-batch", "8", "--max-queued", "16", "--max-paused-s", "10")
NO_WINDOW_GROWTH = (("grpc.http2.bdp_probe", 0),)


def tokenize_flood(target: str, pid: int, stream_tokens: int) -> tuple:
    """(longest and median gap of the concurrent stream in ms, the four calls' outcome, RSS text)."""
    stamps: list[float] = []
    started = threading.Event()

    def stream() -> None:
        with grpc.insecure_channel(target) as channel:
            request = pb.GenerateRequest(prompt_token_ids=[5] * 16, max_new_tokens=stream_tokens, ignore_eos=True)
            for _ in pb_grpc.GeneratorStub(channel).Generate(request, metadata=auth("victim"), timeout=600):
                stamps.append(time.perf_counter())
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    started.wait(120)

    async def flood() -> list[str]:
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            huge = pb.TokenizeRequest(token_ids=[3] * 4_100_000)
            outcomes = await asyncio.gather(*(stub.Tokenize(huge, metadata=auth("hoarder"), timeout=120)
                                              for _ in range(4)), return_exceptions=True)
        return [o.code().name if isinstance(o, grpc.aio.AioRpcError) else "OK" for o in outcomes]

    with RssSampler([pid]) as rss:
        outcomes = asyncio.run(flood())
        reader.join()
    gaps = np.diff(stamps) * 1e3
    return float(gaps.max()), float(np.median(gaps)), ", ".join(sorted(set(outcomes))), rss.text


def hoard(target: str, new_tokens: int, victims: int, window_growth: bool) -> tuple:
    """(victims served, slowest victim's TTFT in ms or its status). ``window_growth``: the hoarder's
    channels keep gRPC's default flow control, whose windows grow to megabytes and hide unread
    streams from the worker; else they stay at 64 KiB."""
    channels = [grpc.insecure_channel(target, options=() if window_growth else NO_WINDOW_GROWTH) for _ in range(24)]
    hoarding = []
    request = pb.GenerateRequest(prompt_token_ids=[7] * 16, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True,
                                 top_logprobs=20)
    for channel in channels:
        call = pb_grpc.GeneratorStub(channel).Generate(request, metadata=auth("hoarder"), timeout=600)
        hoarding.append(call)
    time.sleep(2.0)  # the hoarder's calls reach the worker and fill it (a victim's view: it comes later)
    served, slowest, statuses = 0, 0.0, []
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for i in range(victims):
            sent = time.perf_counter()
            try:
                calls = stub.Generate(pb.GenerateRequest(prompt_token_ids=[9 + i] * 16, max_new_tokens=8, ignore_eos=True),
                                      metadata=auth("victim"), timeout=120)
                first = None
                for _ in calls:
                    first = first or time.perf_counter()
                served += 1
                slowest = max(slowest, (first - sent) * 1e3)
            except grpc.RpcError as err:
                statuses.append(err.code().name)
    for call in hoarding:
        call.cancel()
    for channel in channels:
        channel.close()
    return served, f"{slowest:.0f} ms" if served else "-", ", ".join(sorted(set(statuses))) or "-"


def burst(target: str, count: int, words: int, tenant: str = "victim") -> tuple:
    """(refused, p50 / p99 / max refusal ms, served, other statuses, p99 ms). A ``tenant`` without
    a key is refused UNAUTHENTICATED before the engine sees anything: the floor of a refusal."""
    prompt = " ".join(f"word{i}" for i in range(words))
    metadata = auth(tenant)
    refusal = "RESOURCE_EXHAUSTED" if tenant in KEYS else "UNAUTHENTICATED"

    async def one(stub, i: int) -> tuple[str, float]:
        sent = time.perf_counter()
        try:
            async for _ in stub.Generate(pb.GenerateRequest(prompt=f"{i} {prompt}", max_new_tokens=4, ignore_eos=True),
                                         metadata=metadata, timeout=120):
                pass
            return "OK", 0.0
        except grpc.aio.AioRpcError as err:
            return err.code().name, (time.perf_counter() - sent) * 1e3

    async def run() -> list[tuple[str, float]]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth("victim"))
            return await asyncio.gather(*(one(stub, i) for i in range(count)))

    results = asyncio.run(run())
    refused = [ms for status, ms in results if status == refusal]
    others = sorted({status for status, _ in results} - {"OK", refusal})
    quantiles = (np.percentile(refused, 50), np.percentile(refused, 99), max(refused)) if refused else (0.0,) * 3
    return (len(refused), " / ".join(f"{v:.0f}" for v in quantiles), sum(status == "OK" for status, _ in results),
            ", ".join(others) or "-", float(quantiles[1]))


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    stream_tokens, new_tokens, count, words = (200, 1000, 100, 40) if args.smoke else (STREAM_TOKENS, 1900, 500, 300)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        common = ("--api-keys-file", str(keys_file(Path(tmp))), "--intra-op-threads", str(INTRA_OP_THREADS))
        worker = stack.enter_context(WorkerProcess(model.folder, *common))
        gap_max, gap_median, outcome, rss = tokenize_flood(worker.target, worker.pid, stream_tokens)
        stack.close()
        hoards = []
        for window_growth in (False, True):
            worker = stack.enter_context(WorkerProcess(model.folder, *common, *HOARD_ARGS))
            hoards.append(("default flow control" if window_growth else "windows kept at 64 KiB (bdp_probe=0)",
                           *hoard(worker.target, new_tokens, 6, window_growth)))
            stack.close()
        worker = stack.enter_context(WorkerProcess(model.folder, *common, *HOARD_ARGS))
        bursts = [("at the door (RESOURCE_EXHAUSTED)", *burst(worker.target, count, words)),
                  ("floor: no API key (UNAUTHENTICATED, before the engine)", *burst(worker.target, count, words, "nobody"))]
    print_table(f"Tokenize flood beside a {stream_tokens}-token stream (model {model.name})",
                ("stream gap max / median (ms)", "4 x Tokenize(4.1M ids)", "worker RSS start→peak→end (MiB)"),
                [(f"{gap_max:.0f} / {gap_median:.1f}", outcome, rss)])
    print_table(f"24 unread streams of one tenant, then 6 requests of another ({' '.join(HOARD_ARGS)})",
                ("hoarder's channels", "victims served", "slowest victim TTFT", "victims' refusals"),
                [(name, f"{served} of 6", slowest, statuses) for name, served, slowest, statuses in hoards])
    print_table(f"Burst of {count} requests at once ({' '.join(HOARD_ARGS)})",
                ("burst", "requests refused", "refusal p50 / p99 / max (ms)", "served", "other statuses"),
                [row[:-1] for row in bursts])
    door_p99, floor_p99 = bursts[0][-1], bursts[1][-1]
    print(f"\ndoor refusal p99 {door_p99:.0f} ms (target {REFUSAL_P99_MS:g} ms); the same burst refused before the "
          f"engine: {floor_p99:.0f} ms")
    # The refusal's latency is reported, not judged: past the target it is bounded by the floor, the
    # cost of a gRPC call on this machine while the admitted requests compute (tests/test_fair_share.py
    # shows deterministically that a refused request is never tokenized).
    held = outcome == "INVALID_ARGUMENT" and all(row[1] == 6 for row in hoards) and bursts[0][4] == "-"
    print(f"\nthe door holds: {'yes' if held else 'NO'}")
    return exit_code(held, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
