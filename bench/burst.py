"""A rollout's burst: N requests carrying the same *new* long prefix (different questions) arrive at
once, spread round-robin over R replicas sharing one Redis. How often does the fleet compute that
prefix, and how late is the slowest first token against one cold request alone?

- prefix computed fleet-wide: the prefix tokens that requests computed (not served from the store
  or from another request of the same worker), summed over the burst, divided by the prefix
  length: 1.00 means the fleet computed it once;
- TTFT p50 / p99 (server-side, ms) of the bursts' requests, and the worst burst's p99 against its
  own cold TTFT: the mean of the same prompt shape sent alone, cold, to the idle fleet just before
  and just after that burst (a burst's 8 TTFTs make its p99 its slowest first token);
- that burst's CPU to its last first token: the CPU seconds that the workers, Redis and this
  client used together from sending the burst until its last first token arrived here, and that
  divided by the cores this machine gives them, against its cold TTFT: how long that work takes
  with every core busy. With the replicas on one machine, a p99 / cold close to it means the burst kept the
  cores busy to its end, and it was the work, not the waiting, that set its p99 (replicas of a
  real fleet each have their own cores). It counts all work done by then, some of which no first
  token needed (earlier requests' next tokens, publishes), so it is not a strict bound.

Each replica count ends with one more burst while Redis is down: it must complete with the same
answers and nobody waiting for a lease; each worker computes the prefix at most once per request
(once, when its requests overlap in time).

Every answer is compared with the same prompt computed cold (greedy, EOS ignored).

    .venv/bin/python -m bench.burst [--smoke] [--model DIR] [--requests N] [--replicas R [R ...]]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from bench.batch import GenAIEngine
from bench.fleet import (
    CALL_TIMEOUT_S,
    QUESTION_TOKENS,
    Fleet,
    bench_model,
    fleet,
    median,
    parse_args,
    print_table,
    warm_up,
)
from bench.process_cpu import ProcessCpu, cores
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete

NEW_TOKENS = 4


@dataclass(frozen=True, slots=True)
class Answer:
    tokens: list[int]
    cached: int
    ttft_ms: float


def request(prompt: list[int], cold: bool = False) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              cache=pb.CacheOptions(skip_read=cold, skip_write=cold))


@dataclass(slots=True)
class Burst:
    answers: list[Answer]
    cpu_s: float
    """CPU seconds of every process of the fleet and of this client until the last first token."""


async def ask(stub: pb_grpc.GeneratorStub, prompt: list[int], first: Callable[[], None]) -> Answer:
    tokens, last = [], None
    async for message in stub.Generate(request(prompt), timeout=CALL_TIMEOUT_S):
        if last is None:
            first()
        tokens.extend(message.token_ids)
        last = message
    return Answer(tokens, last.usage.cached_prompt_tokens, last.timings.time_to_first_token_ms)


def send_burst(f: Fleet, prompts: list[list[int]]) -> Burst:
    """Sends every prompt at once, prompt i to replica i mod R."""
    pids = [*(w.pid for w in f.workers), os.getpid(), *([f.redis.pid] if f.redis.pid is not None else [])]
    cpu: ProcessCpu | None = None
    firsts, cpu_s = 0, 0.0

    def first() -> None:
        nonlocal firsts, cpu_s
        firsts += 1
        if firsts == len(prompts):
            cpu_s = cpu.used()

    async def run() -> list[Answer]:
        nonlocal cpu
        channels = [grpc.aio.insecure_channel(w.target) for w in f.workers]
        try:
            stubs = [pb_grpc.GeneratorStub(c) for c in channels]
            cpu = ProcessCpu(pids)
            return list(await asyncio.gather(*(ask(stubs[i % len(stubs)], p, first) for i, p in enumerate(prompts))))
        finally:
            for channel in channels:
                await channel.close()

    return Burst(asyncio.run(run()), cpu_s)


@dataclass(frozen=True, slots=True)
class Measured:
    """One burst: its requests' TTFTs and the cold TTFT it is compared with (ms), and the CPU
    seconds to its last first token (None where not measured)."""

    ttfts: list[float]
    cold_ms: float
    cpu_s: float | None = None

    @property
    def ratio(self) -> float:
        return float(np.percentile(self.ttfts, 99)) / self.cold_ms


def row(name: str, computed: list[float], bursts: list[Measured]) -> tuple:
    """TTFT p50 / p99 over every burst's requests; the worst burst's p99 over its own cold TTFT,
    with that burst's CPU to its last first token and what that takes on this machine's cores."""
    ttfts = [t for burst in bursts for t in burst.ttfts]
    p50, p99 = float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 99))
    cold_ms = median([burst.cold_ms for burst in bursts])
    worst = max(bursts, key=lambda burst: burst.ratio)
    if worst.cpu_s is None:
        return name, float(np.mean(computed)), cold_ms, p50, p99, worst.ratio, "", ""
    return name, float(np.mean(computed)), cold_ms, p50, p99, worst.ratio, worst.cpu_s, \
        worst.cpu_s / cores() * 1e3 / worst.cold_ms


def genai_rows(model, rng: np.random.Generator, requests: int, prefix_len: int, bursts: int) -> list[tuple]:
    """The peer: ONNX Runtime GenAI's og.Engine (one process, its own prefix cache, ``requests``
    static-batching rows) on the same folder, given the same bursts; the prefix it computed is not
    reported, so that column is empty."""
    genai = GenAIEngine(model, requests)
    measured = []

    def cold_alone() -> float:
        return genai.load([model.random_ids(rng, prefix_len + QUESTION_TOKENS)], [NEW_TOKENS]).streams[0].ttft * 1e3

    for _ in range(bursts):
        before = cold_alone()
        prefix = model.random_ids(rng, prefix_len)
        prompts = [prefix + model.random_ids(rng, QUESTION_TOKENS) for _ in range(requests)]
        ttfts = [s.ttft * 1e3 for s in genai.load(prompts, [NEW_TOKENS] * requests).streams]
        measured.append(Measured(ttfts, (before + cold_alone()) / 2))
    return [(f"og.Engine, {requests} requests, one process", "", *row("", [0.0], measured)[2:])]


def main() -> int:
    def options(parser) -> None:
        parser.add_argument("--requests", type=int, default=8)
        parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
        parser.add_argument("--prefix", type=int, default=2048, help="new shared prefix, tokens")
        parser.add_argument("--bursts", type=lambda v: max(1, int(v)), default=3,
                            help="bursts per replica count, each on a fresh prefix (at least 1)")

    args = parse_args(__doc__.splitlines()[0], options)
    model = bench_model(args)
    prefix_len, bursts = (256, 1) if args.smoke else (args.prefix, args.bursts)
    rng = np.random.default_rng(0)
    rows, wrong = [], 0
    for replicas in args.replicas:
        with fleet(model, replicas=replicas) as f:
            # A rollout's burst meets replicas that have been serving: besides a cold request each,
            # one burst on a throwaway prefix takes the workers through the store, leases and
            # batched steps once (the first burst of fresh workers used 7-15% more CPU).
            warm_up(f.stubs, model.random_ids(rng, prefix_len + QUESTION_TOKENS))
            prefix = model.random_ids(rng, prefix_len)
            send_burst(f, [prefix + model.random_ids(rng, QUESTION_TOKENS) for _ in range(args.requests)])
            f.client.flushdb()
            computed, measured = [], []

            def cold_alone(replica: int) -> float:
                prompt = model.random_ids(rng, prefix_len + QUESTION_TOKENS)
                return complete(f.stubs[replica % replicas], request(prompt), CALL_TIMEOUT_S).last.timings.time_to_first_token_ms

            for b in range(bursts):
                # A cold request alone just before and just after each burst, on the replicas in
                # turn: on a shared machine the pace drifts by a third within minutes, and a ratio
                # must compare what was measured in the same stretch of time.
                before = cold_alone(b)
                prefix = model.random_ids(rng, prefix_len)
                prompts = [prefix + model.random_ids(rng, QUESTION_TOKENS) for _ in range(args.requests)]
                t, logged = time.perf_counter(), [len(w.log_lines) for w in f.workers]
                burst = send_burst(f, prompts)
                span_s, answers = time.perf_counter() - t, burst.answers
                measured.append(Measured([a.ttft_ms for a in answers], (before + cold_alone(b + 1)) / 2, burst.cpu_s))
                references = [complete(f.stubs[0], request(p, cold=True), CALL_TIMEOUT_S).token_ids for p in prompts]
                wrong += sum(a.tokens != r for a, r in zip(answers, references, strict=True))
                computed.append(sum(prefix_len - min(a.cached, prefix_len) for a in answers) / prefix_len)
                print(f"{replicas} replicas: prefix computed {computed[-1]:.2f}x, slowest first token "
                      f"{max(a.ttft_ms for a in answers):.0f} ms, burst done in {span_s:.2f} s, "
                      f"{burst.cpu_s:.2f} CPU s to the last first token", flush=True)
                if computed[-1] > 1.0:  # the workers log each wait that ended before its blocks came
                    for i, (w, start) in enumerate(zip(f.workers, logged, strict=True)):
                        for line in w.log_lines[start:]:
                            if "waited" in line:
                                print(f"  replica {i}: {line}", flush=True)
                f.client.flushdb()
            rows.append(row(f"{args.requests} requests / {replicas} replicas", computed, measured))
            # The same burst with Redis down: leases and blocks are gone; each worker computes once.
            f.redis.kill()
            prefix = model.random_ids(rng, prefix_len)
            prompts = [prefix + model.random_ids(rng, QUESTION_TOKENS) for _ in range(args.requests)]
            down_burst = send_burst(f, prompts)
            answers = down_burst.answers
            references = [complete(f.stubs[0], request(p, cold=True), CALL_TIMEOUT_S).token_ids for p in prompts]
            wrong += sum(a.tokens != r for a, r in zip(answers, references, strict=True))
            down = [sum(prefix_len - min(a.cached, prefix_len) for a in answers) / prefix_len]
            cold_ms = median([burst.cold_ms for burst in measured])
            rows.append(row("same, Redis down", down, [Measured([a.ttft_ms for a in answers], cold_ms, down_burst.cpu_s)]))
            f.redis.start()
    rows += genai_rows(model, rng, args.requests, prefix_len, bursts)
    print_table(f"{model.name} model, new {prefix_len}-token prefix + {QUESTION_TOKENS}-token questions, sent at once "
                f"round-robin; {bursts} bursts each; server-side TTFT (og.Engine: in-process, from submission)",
                ("burst", "prefix computed fleet-wide (x)", "cold alone TTFT ms", "burst TTFT p50 ms",
                 "burst TTFT p99 ms", "worst burst: p99 / its cold", "its CPU s to last first token",
                 f"that / {cores()} cores / its cold"), rows)
    print(f"\nanswers differing from cold: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
