"""The OpenAI-compatible HTTP face against gRPC: 16 concurrent streams through each face of one
worker, side by side in one run.

One ``kvshare serve --http-port P`` serves both faces (its HTTP face is a gRPC client of the same
process's server, over a Unix socket), so what differs between the sides is the face and its
client. Every side sends the same requests: random token-id prompts, greedy, the same
``max_tokens`` with EOS ignored, so that all generate the same tokens (checked: the same text).

- gRPC: ``grpc.aio`` with the generated stub, one channel; tokens counted from the messages'
  ``token_ids``.
- HTTP: the official ``openai`` client (``AsyncOpenAI``, what users call), streaming text
  completions (``/v1/completions``) with ``stream_options.include_usage``; tokens counted from the
  final usage. Text completions, not chat: they take the prompt as token ids and make exactly the
  gRPC request (no chat template to render, no text to tokenize), so every side asks the same.
- HTTP aiohttp: the same requests read by a minimal client (aiohttp, ``json.loads`` per event), to
  tell the face's own cost from the ``openai`` client's: both share the bench's 2 cores with the
  worker. Not part of the targets.

Rounds rotate the sides' order, each round on fresh prompts that every side of the round gets, so
that a noisy moment of the shared machine hits all alike; each (round, side) has a cache salt of
its own, so nothing hits the cache and every side computes and publishes the same blocks. The
clients, their connections and the worker are warmed up first. Then each side sends one request at
a time to the idle worker: the face's latency without a queue.

Tokens/s: all streams' generated tokens over the wall time from the first request sent to the last
stream ended (the usage event and ``[DONE]`` received). TTFT: client-side, from the call to the
first gRPC message, or the first event, that carries generated text (what a user sees first). CPU:
the bench process's (the clients) and the worker's, per round.

Targets (HTTP through ``openai`` against gRPC, medians over rounds of each round's figures):
tokens/s ratio ≥ 0.9; TTFT p50 difference ≤ +10 ms.

    .venv/bin/python -m bench.http [--smoke] [--model DIR] [--rounds R]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import sys
import time

import aiohttp
import grpc
import numpy as np
from openai import AsyncOpenAI

from bench.fleet import (
    INTRA_OP_THREADS,
    BenchModel,
    bench_model,
    median,
    parse_args,
    print_table,
)
from bench.process_cpu import cpu_seconds
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.model_catalogue import fetch_model
from services.local.redis_process import free_port
from services.local.worker_process import WorkerProcess

STREAMS = 16
CALL_TIMEOUT_S = 300.0
TOKENS_PER_S_RATIO = 0.9
TTFT_P50_EXTRA_MS = 10.0
GRPC, HTTP, AIOHTTP = "gRPC", "HTTP", "HTTP aiohttp"
SIDES = (GRPC, HTTP, AIOHTTP)
ALONE_TOKENS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    rounds: int
    prompt_tokens: int
    new_tokens: int
    alone: int
    """Requests of each side sent one at a time to the idle worker (``ALONE_TOKENS`` each)."""


# 32-token prompts: 16 of them prefill in two steps, so TTFT is the face's and a step's, not a
# queue of prefills whose length swings by hundreds of ms between rounds (128-token prompts did).
SIZES = Sizes(rounds=7, prompt_tokens=32, new_tokens=64, alone=20)
SMOKE_SIZES = Sizes(rounds=1, prompt_tokens=32, new_tokens=8, alone=1)


@dataclasses.dataclass(slots=True)
class Stream:
    """One request as its client saw it (``perf_counter()`` seconds)."""

    sent: float
    first: float = 0.0
    """When the first generated text arrived."""
    ended: float = 0.0
    tokens: int = 0
    text: str = ""
    events: int = 0
    """gRPC messages or server-sent events received."""

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    def add(self, text: str) -> None:
        if text and not self.first:
            self.first = time.perf_counter()
        self.events += 1
        self.text += text


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
    side: str
    streams: list[Stream]
    client_cpu_s: float
    worker_cpu_s: float

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (max(s.ended for s in self.streams) - min(s.sent for s in self.streams))

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(s.ttft for s in self.streams) * 1e3

    @property
    def events_per_stream(self) -> float:
        return statistics.mean(s.events for s in self.streams)

    @property
    def client_us_per_event(self) -> float:
        return self.client_cpu_s / sum(s.events for s in self.streams) * 1e6


class Clients:
    """Every side's client of one worker, made once and reused (as a serving client would be)."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker_pid = worker.pid
        self.channel = grpc.aio.insecure_channel(worker.target)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.openai = AsyncOpenAI(base_url=f"http://{worker.http_target}/v1", api_key="unused", max_retries=0)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        self.completions_url = f"http://{worker.http_target}/v1/completions"
        self.model = ""
        self._calls = {GRPC: self.grpc_stream, HTTP: self.openai_stream, AIOHTTP: self.aiohttp_stream}

    async def start(self) -> None:
        self.model = (await self.openai.models.list()).data[0].id

    async def close(self) -> None:
        await self.session.close()
        await self.openai.close()
        await self.channel.close()

    async def grpc_stream(self, prompt: list[int], new_tokens: int, salt: str) -> Stream:
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new_tokens, ignore_eos=True,
                                     cache=pb.CacheOptions(salt=salt))
        stream = Stream(time.perf_counter())
        async for message in self.stub.Generate(request, timeout=CALL_TIMEOUT_S):
            stream.add(message.text)
            stream.tokens += len(message.token_ids)
        stream.ended = time.perf_counter()
        return stream

    async def openai_stream(self, prompt: list[int], new_tokens: int, salt: str) -> Stream:
        stream = Stream(time.perf_counter())
        events = await self.openai.completions.create(
            model=self.model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "cache_salt": salt},
            timeout=CALL_TIMEOUT_S)
        async for event in events:
            stream.add(event.choices[0].text if event.choices else "")
            if event.usage is not None:
                stream.tokens = event.usage.completion_tokens
        stream.ended = time.perf_counter()
        return stream

    async def aiohttp_stream(self, prompt: list[int], new_tokens: int, salt: str) -> Stream:
        stream = Stream(time.perf_counter())
        body = {"model": self.model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "cache_salt": salt}
        async with self.session.post(self.completions_url, json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue  # the blank line between events, and data: [DONE]
                event = json.loads(line[6:])
                stream.add(event["choices"][0]["text"] if event["choices"] else "")
                if event.get("usage"):
                    stream.tokens = event["usage"]["completion_tokens"]
        stream.ended = time.perf_counter()
        return stream

    async def round(self, side: str, prompts: list[list[int]], new_tokens: int, salt: str) -> Round:
        """Every prompt at once through ``side``."""
        client, worker = time.process_time(), cpu_seconds(self.worker_pid)
        streams = await asyncio.gather(*(self._calls[side](p, new_tokens, salt) for p in prompts))
        return Round(side, list(streams), time.process_time() - client, cpu_seconds(self.worker_pid) - worker)


@dataclasses.dataclass(frozen=True, slots=True)
class Trial:
    """One round of each side on the same prompts, in ``order``."""

    rounds: dict[str, Round]
    order: tuple[str, ...]

    def ratio(self, side: str) -> float:
        return self.rounds[side].tokens_per_s / self.rounds[GRPC].tokens_per_s

    def ttft_extra_ms(self, side: str) -> float:
        return self.rounds[side].ttft_p50_ms - self.rounds[GRPC].ttft_p50_ms

    def worker_extra_us_per_token(self, side: str) -> float:
        """Worker CPU beyond gRPC's for the same tokens, per token (resolution: a clock tick)."""
        extra = self.rounds[side].worker_cpu_s - self.rounds[GRPC].worker_cpu_s
        return extra / self.rounds[GRPC].tokens * 1e6

    def mismatches(self, new_tokens: int) -> list[str]:
        """Streams that did not generate ``new_tokens`` tokens or no text, or whose texts differ
        between sides."""
        bad = []
        for i, streams in enumerate(zip(*(self.rounds[s].streams for s in SIDES), strict=True)):
            if any(s.tokens != new_tokens or not s.first or s.text != streams[0].text for s in streams):
                bad.append(f"stream {i}: tokens " + ", ".join(f"{side} {s.tokens}" for side, s in zip(SIDES, streams))
                           + f", same text {all(s.text == streams[0].text for s in streams)}")
        return bad


async def measure(worker: WorkerProcess, model: BenchModel, sizes: Sizes) -> tuple[list[Trial], list[Trial]]:
    """The concurrent rounds, then the requests alone."""
    clients = Clients(worker)
    rng = np.random.default_rng(30)

    async def trial(name: str, r: int, streams: int, new_tokens: int) -> Trial:
        prompts = [model.random_ids(rng, sizes.prompt_tokens) for _ in range(streams)]
        order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
        done = {side: await clients.round(side, prompts, new_tokens, f"{name}-{r}-{side}") for side in order}
        return Trial(done, order)

    try:
        await clients.start()
        # Opens the HTTP connections; the worker's first full-size batch is slower than the next.
        await trial("warm-up", 0, STREAMS, sizes.new_tokens)
        rounds = []
        for r in range(sizes.rounds):
            rounds.append(await trial("round", r, STREAMS, sizes.new_tokens))
            print(f"round {r + 1} of {sizes.rounds} done", flush=True)
        return rounds, [await trial("alone", r, 1, ALONE_TOKENS) for r in range(sizes.alone)]
    finally:
        await clients.close()


def report(model: BenchModel, sizes: Sizes, rounds: list[Trial], alone: list[Trial]) -> tuple[float, float]:
    """Prints the tables; returns the targets' figures (tokens/s ratio, TTFT p50 ms difference)."""
    rows = [(i + 1, " > ".join(t.order), t.rounds[GRPC].tokens_per_s, t.rounds[HTTP].tokens_per_s, t.ratio(HTTP),
             t.rounds[GRPC].ttft_p50_ms, t.rounds[HTTP].ttft_p50_ms, t.ttft_extra_ms(HTTP)) for i, t in enumerate(rounds)]
    ratio, extra = median(t.ratio(HTTP) for t in rounds), median(t.ttft_extra_ms(HTTP) for t in rounds)
    rows.append(("median", "", median(r[2] for r in rows), median(r[3] for r in rows), ratio,
                 median(r[5] for r in rows), median(r[6] for r in rows), extra))
    print_table(f"{model.name}, {STREAMS} concurrent streams of {sizes.prompt_tokens} prompt + {sizes.new_tokens} new "
                f"tokens, greedy, one worker ({INTRA_OP_THREADS} intra-op threads, --max-batch {STREAMS}); HTTP: "
                "openai AsyncOpenAI streaming /v1/completions; gRPC: grpc.aio stub",
                ("round", "order", "gRPC tok/s", "HTTP tok/s", "HTTP / gRPC", "gRPC TTFT p50 ms",
                 "HTTP TTFT p50 ms", "HTTP − gRPC ms"), rows)
    print_table(f"Every side, medians of the {len(rounds)} rounds (differences and ratios: each round's against its gRPC)",
                ("side", "tok/s", "× gRPC", "TTFT p50 ms", "− gRPC ms", "alone: TTFT ms", "alone: − gRPC ms",
                 "messages or events per stream", "client CPU µs per event", "worker CPU − gRPC's, µs per token"),
                [(side, median(t.rounds[side].tokens_per_s for t in rounds), median(t.ratio(side) for t in rounds),
                  median(t.rounds[side].ttft_p50_ms for t in rounds), median(t.ttft_extra_ms(side) for t in rounds),
                  median(t.rounds[side].ttft_p50_ms for t in alone),
                  median(t.ttft_extra_ms(side) for t in alone),
                  median(t.rounds[side].events_per_stream for t in rounds),
                  median(t.rounds[side].client_us_per_event for t in rounds),
                  median(t.worker_extra_us_per_token(side) for t in rounds)) for side in SIDES])
    print(f"\n(alone: {len(alone)} single requests of {sizes.prompt_tokens} prompt + {ALONE_TOKENS} new tokens per side, "
          "one at a time on the idle worker, sides rotating)")
    return ratio, extra


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--rounds", type=int, default=None, help=f"rounds of each side (default {SIZES.rounds}; smoke 1)"),
        model_help="model folder to measure instead of SmolLM2-135M-Instruct (tiny preset for --smoke)")
    if args.model is None and not args.smoke:
        model = BenchModel.of(fetch_model("smollm2-135m-instruct"), "SmolLM2-135M-Instruct")
    else:
        model = bench_model(args)  # --model, or the tiny preset
    sizes = SMOKE_SIZES if args.smoke else SIZES
    if args.rounds:
        sizes = dataclasses.replace(sizes, rounds=args.rounds)
    with WorkerProcess(model.folder, "--intra-op-threads", str(INTRA_OP_THREADS), "--max-batch", str(STREAMS),
                       "--http-port", str(free_port())) as worker:
        rounds, alone = asyncio.run(measure(worker, model, sizes))
    ratio, extra = report(model, sizes, rounds, alone)
    met_rate, met_ttft = ratio >= TOKENS_PER_S_RATIO, extra <= TTFT_P50_EXTRA_MS
    print(f"\n{STREAMS} streams, HTTP (openai) against gRPC: tokens/s {ratio:.2f} (target ≥ {TOKENS_PER_S_RATIO}): "
          f"{'met' if met_rate else 'MISSED'}; TTFT p50 {extra:+.1f} ms (target ≤ +{TTFT_P50_EXTRA_MS:.0f} ms): "
          f"{'met' if met_ttft else 'MISSED'}")
    bad = [f"round {i + 1} {m}" for i, t in enumerate(rounds) for m in t.mismatches(sizes.new_tokens)]
    bad += [f"alone {i + 1} {m}" for i, t in enumerate(alone) for m in t.mismatches(ALONE_TOKENS)]
    if bad:
        print("\nFAILED: the sides generated different tokens: " + "; ".join(bad), file=sys.stderr)
        return 1
    # A smoke run checks that every side works and agrees; its timings on the tiny model mean nothing.
    return 0 if args.smoke or (met_rate and met_ttft) else 1


if __name__ == "__main__":
    sys.exit(main())
