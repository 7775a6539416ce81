"""Prefix-aware routing (`kvshare route`) against round-robin, in the same run: 4 system prompts x 64
requests (each a system prompt + its own question, greedy, 8-token answers) over 2 workers sharing
one Redis through a `tiered+` store, an in-worker memory L1 in front of Redis.

Each mode starts fresh workers (empty L1s) on a Redis that already holds every system prompt (a
seeding worker published them), sends the same requests in the same order from the same number of
concurrent clients, and stops its workers. What differs is where a request goes: through the
router (the worker that rendezvous hashing picks for its prompt's first 64 token ids), or to
worker i mod 2 for the i-th request. Each worker's L1 holds ``--l1-prompts`` system prompts' blocks
(2 of the 4 by default): the fleet's L1s hold every prompt once only if a prompt keeps to one worker.

- L1 hit rate: of the cached blocks the requests read, the share a worker's own L1 answered. The
  others were read from Redis, which counts them (``keyspace_hits`` + ``keyspace_misses``, before
  and after the requests): nothing else reads Redis during them, since every prompt is cached and
  no answer fills a block.
- TTFT p50 / p99: from sending a request to its first message, at the client (the router's hop
  included), ms.
- prompts per worker: how many of the system prompts each worker served (from its log lines).

    .venv/bin/python -m bench.route [--smoke] [--model DIR] [--l1-prompts K] [--clients C]
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import numpy as np

from bench.fleet import (
    CALL_TIMEOUT_S,
    INTRA_OP_THREADS,
    QUESTION_TOKENS,
    BenchModel,
    bench_model,
    parse_args,
    print_table,
    wait_for_keys,
    warm_up,
)
from bench.verdict import exit_code
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.local.redis_process import RedisServer
from services.local.worker_process import RouterProcess, WorkerProcess

SYSTEM_PROMPTS = 4
ANSWER_TOKENS = 8
BLOCK_SIZE = 64
BLOCK_KEYS = "kvshare:v1:blk:*"


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    system: int
    """Index of its system prompt."""
    prompt: list[int]


@dataclass(frozen=True, slots=True)
class Answer:
    ttft_ms: float
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ModeResult:
    name: str
    l1_hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    prompts_per_worker: str
    redis_misses: int
    fully_cached: bool


def seed(model: BenchModel, redis_server: RedisServer, systems: list[list[int]], rng: np.random.Generator) -> int:
    """Publishes every system prompt to Redis through a worker of its own (its L1 dies with it);
    returns the size in bytes of one stored block."""
    with WorkerProcess(model.folder, "--cache", redis_server.url, "--block-size", str(BLOCK_SIZE),
                       "--intra-op-threads", str(INTRA_OP_THREADS)) as worker, \
            grpc.insecure_channel(worker.target) as channel, redis_server.client() as client:
        stub = pb_grpc.GeneratorStub(channel)
        for system in systems:
            complete(stub, pb.GenerateRequest(prompt_token_ids=system + model.random_ids(rng, QUESTION_TOKENS),
                                              max_new_tokens=1), CALL_TIMEOUT_S)
        blocks = sum(len(s) // BLOCK_SIZE for s in systems)
        wait_for_keys(client, blocks)
        keys = client.keys(BLOCK_KEYS)
        assert len(keys) == blocks, f"Redis holds {len(keys)} blocks, expected {blocks}"
        return int(client.strlen(keys[0]))


def ask(stub: pb_grpc.GeneratorStub, request: Request) -> Answer:
    sent, first, last = time.perf_counter(), None, None
    message = pb.GenerateRequest(request_id=request.request_id, prompt_token_ids=request.prompt,
                                 max_new_tokens=ANSWER_TOKENS, ignore_eos=True)
    for response in stub.Generate(message, timeout=CALL_TIMEOUT_S):
        first = first or time.perf_counter()
        last = response
    return Answer((first - sent) * 1e3, last.usage.cached_prompt_tokens)


def redis_lookups(redis_server: RedisServer) -> tuple[int, int]:
    with redis_server.client() as client:
        stats = client.info("stats")
    return int(stats["keyspace_hits"]), int(stats["keyspace_misses"])


def run_mode(name: str, routed: bool, model: BenchModel, redis_server: RedisServer, requests: list[Request],
             system_tokens: int, l1_bytes: int, clients: int, rng: np.random.Generator) -> ModeResult:
    args = ("--cache", f"tiered+{redis_server.url}", "--cache-l1-bytes", str(l1_bytes), "--block-size", str(BLOCK_SIZE),
            "--intra-op-threads", str(INTRA_OP_THREADS))
    with ExitStack() as stack:
        workers = [stack.enter_context(WorkerProcess(model.folder, *args)) for _ in range(2)]
        worker_stubs = [pb_grpc.GeneratorStub(stack.enter_context(w.channel())) for w in workers]
        warm_up(worker_stubs, model.random_ids(rng, system_tokens + QUESTION_TOKENS))  # reads and writes no cache
        if routed:
            router = stack.enter_context(RouterProcess([w.target for w in workers]))
            router_stub = pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(router.target)))
            warm_up([router_stub] * 2, model.random_ids(rng, system_tokens + QUESTION_TOKENS))  # the router's path too
        hits, misses = redis_lookups(redis_server)
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda ir: ask(router_stub if routed else worker_stubs[ir[0] % 2], ir[1]),
                                    enumerate(requests)))
        after_hits, after_misses = redis_lookups(redis_server)
        served = [{r.system for r in requests if any(f"request {r.request_id} " in line for line in w.log_lines)}
                  for w in workers]
    blocks_read = sum(len(r.prompt) // BLOCK_SIZE for r in requests)
    from_redis = (after_hits - hits) + (after_misses - misses)
    ttfts = [a.ttft_ms for a in answers]
    return ModeResult(name, 1.0 - from_redis / blocks_read, float(np.percentile(ttfts, 50)),
                      float(np.percentile(ttfts, 99)), " / ".join(str(len(s)) for s in served),
                      after_misses - misses, all(a.cached_tokens == system_tokens for a in answers))


def main() -> int:
    def options(parser) -> None:
        parser.add_argument("--l1-prompts", type=int, default=2,
                            help="system prompts' blocks each worker's L1 holds (of the 4)")
        parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
        parser.add_argument("--requests-per-prompt", type=int, default=64)

    args = parse_args(__doc__.splitlines()[0], options)
    model = bench_model(args)
    system_tokens, per_prompt = (4 * BLOCK_SIZE, 8) if args.smoke else (16 * BLOCK_SIZE, args.requests_per_prompt)
    rng = np.random.default_rng(0)
    systems = [model.random_ids(rng, system_tokens) for _ in range(SYSTEM_PROMPTS)]
    order = [s for s in range(SYSTEM_PROMPTS) for _ in range(per_prompt)]
    random.Random(0).shuffle(order)
    with RedisServer() as redis_server:
        block_bytes = seed(model, redis_server, systems, rng)
        l1_bytes = args.l1_prompts * (system_tokens // BLOCK_SIZE) * block_bytes
        results = []
        for name, routed in (("round-robin", False), ("kvshare route", True)):
            requests = [Request(f"{name.split()[-1]}-{i}", s, systems[s] + model.random_ids(rng, QUESTION_TOKENS))
                        for i, s in enumerate(order)]
            results.append(run_mode(name, routed, model, redis_server, requests, system_tokens, l1_bytes,
                                    args.clients, rng))
            print(f"{name}: done", flush=True)
    rows = [(r.name, f"{100 * r.l1_hit_rate:.1f}%", r.ttft_p50_ms, r.ttft_p99_ms, r.prompts_per_worker)
            for r in results]
    plain, routed = results
    ratios = [(a / b if b else float("inf")) for a, b in ((routed.l1_hit_rate, plain.l1_hit_rate),
                                                            (routed.ttft_p50_ms, plain.ttft_p50_ms),
                                                            (routed.ttft_p99_ms, plain.ttft_p99_ms))]
    rows.append(("route / round-robin", *(f"{r:.2f}x" for r in ratios), ""))
    print_table(f"{model.name} model, {SYSTEM_PROMPTS} system prompts of {system_tokens} tokens x {per_prompt} "
                f"requests (+{QUESTION_TOKENS}-token questions, {ANSWER_TOKENS}-token answers), 2 workers on tiered+redis, "
                f"L1 of {l1_bytes / 2**20:.1f} MiB per worker ({args.l1_prompts} system prompts), {args.clients} clients",
                ("mode", "L1 hit rate", "TTFT p50 ms", "TTFT p99 ms", "system prompts per worker"), rows)
    bad = [r.name for r in results if r.redis_misses or not r.fully_cached]
    if bad:
        print(f"\nFAILED: {', '.join(bad)}: a request missed a block in Redis or computed part of its system prompt, "
              "so the L1 hit rate above is not what it says", file=sys.stderr)
    return exit_code(not bad, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
