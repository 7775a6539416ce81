"""Benchmark that picks the default cache block size (``--block-size``).

For each block size, two workers A and B share one Redis server. Each run takes a fresh random
2048-token prefix and sends it with a 32-token question:

* to A with ``skip_read`` and ``skip_write``: the no-cache baseline;
* to A with the cache on: cold (nothing cached yet, so it pays hashing, a missed lookup, and
  publishes its blocks after the first token);
* once A's blocks are in Redis, the same prefix with another question to B: warm (it fetches the
  prefix's full blocks and computes only the rest).

All times are the workers' own ``time_to_first_token_ms`` and ``cache_fetch_ms``; the table shows
medians per block size.

Run from the repository root (the script puts the root on ``sys.path`` itself):

    .venv/bin/python bench/block_size.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvshare.v1 import generator_pb2 as pb  # noqa: E402
from kvshare.v1 import generator_pb2_grpc as pb_grpc  # noqa: E402
from services.client import complete  # noqa: E402
from services.demo import ensure_model  # noqa: E402
from services.redis_process import RedisServer  # noqa: E402
from services.worker_process import WorkerProcess  # noqa: E402

BLOCK_SIZES = (16, 64, 128, 256)
RUNS = 5
PREFIX_TOKENS = 2048
QUESTION_TOKENS = 32
FIRST_TOKEN_ID = 3  # ids below are the tokenizer's special tokens
VOCAB_SIZE = 8000
SEED = 0
INTRA_OP_THREADS = 2
CALL_TIMEOUT_S = 120.0
PUBLISH_TIMEOUT_S = 5.0
MODEL_DIR = Path(tempfile.gettempdir()) / "kvshare-bench" / "decoder-bench"


def cached_prefix_tokens(block_size: int) -> int:
    """Tokens of the shared prefix that lie in full blocks: what a warm request fetches."""
    return (PREFIX_TOKENS // block_size) * block_size


@dataclass(slots=True)
class Samples:
    """Per-run measurements for one block size, in milliseconds."""

    no_cache_ttft: list[float] = field(default_factory=list)
    cold_ttft: list[float] = field(default_factory=list)
    warm_ttft: list[float] = field(default_factory=list)
    warm_fetch: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Row:
    """The medians reported for one block size."""

    block_size: int
    cached_tokens: int
    cold_ttft: float
    no_cache_ttft: float
    warm_ttft: float
    warm_fetch: float

    @classmethod
    def from_samples(cls, block_size: int, samples: Samples) -> Row:
        return cls(
            block_size=block_size,
            cached_tokens=cached_prefix_tokens(block_size),
            cold_ttft=statistics.median(samples.cold_ttft),
            no_cache_ttft=statistics.median(samples.no_cache_ttft),
            warm_ttft=statistics.median(samples.warm_ttft),
            warm_fetch=statistics.median(samples.warm_fetch),
        )


def random_ids(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, VOCAB_SIZE, size=count).tolist()


def generate(stub: pb_grpc.GeneratorStub, prompt: list[int], skip_cache: bool = False) -> pb.GenerateResponse:
    """One single-token Generate call; returns its last message (usage and timings)."""
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=1, ignore_eos=True,
        cache=pb.CacheOptions(skip_read=skip_cache, skip_write=skip_cache),
    )
    return complete(stub, request, timeout_s=CALL_TIMEOUT_S).last


def wait_for_keys(client: redis.Redis, count: int, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
    """Polls DBSIZE until Redis holds at least ``count`` keys (a worker's publish landed)."""
    deadline = time.monotonic() + timeout_s
    while client.dbsize() < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis holds {client.dbsize()} keys after {timeout_s} s, expected {count}")
        time.sleep(0.01)


def published_after(client: redis.Redis, new_blocks: int) -> Callable[[], None]:
    """Call before a request that publishes ``new_blocks`` blocks; the result waits for them."""
    expected = client.dbsize() + new_blocks
    return lambda: wait_for_keys(client, expected)


def measure_no_cache(a: pb_grpc.GeneratorStub, prompt: list[int], samples: Samples) -> None:
    samples.no_cache_ttft.append(generate(a, prompt, skip_cache=True).timings.time_to_first_token_ms)


def measure_cold(a: pb_grpc.GeneratorStub, client: redis.Redis, prompt: list[int], block_size: int,
                 samples: Samples) -> None:
    """Sends ``prompt`` (nothing of it cached) to A and returns once A's publish is in Redis."""
    a_published = published_after(client, len(prompt) // block_size)
    cold = generate(a, prompt)
    assert cold.usage.cached_prompt_tokens == 0, f"cold request found {cold.usage.cached_prompt_tokens} cached tokens"
    samples.cold_ttft.append(cold.timings.time_to_first_token_ms)
    a_published()


def measure_warm(b: pb_grpc.GeneratorStub, client: redis.Redis, prompt: list[int], block_size: int,
                 samples: Samples) -> None:
    """Sends ``prompt`` (its prefix cached by A) to B; waits for B's publish so it does not overlap the next run."""
    cached = cached_prefix_tokens(block_size)
    b_published = published_after(client, (len(prompt) - cached) // block_size)
    warm = generate(b, prompt)
    assert warm.usage.cached_prompt_tokens == cached, (
        f"block {block_size}: warm request cached {warm.usage.cached_prompt_tokens} tokens, expected {cached}")
    samples.warm_ttft.append(warm.timings.time_to_first_token_ms)
    samples.warm_fetch.append(warm.timings.cache_fetch_ms)
    b_published()


def run_once(a: pb_grpc.GeneratorStub, b: pb_grpc.GeneratorStub, client: redis.Redis, block_size: int,
             rng: np.random.Generator, baseline_first: bool, samples: Samples) -> None:
    """No-cache and cold requests on a fresh prefix (in the given order), then the warm one."""
    prefix = random_ids(rng, PREFIX_TOKENS)
    prompt_a = prefix + random_ids(rng, QUESTION_TOKENS)
    prompt_b = prefix + random_ids(rng, QUESTION_TOKENS)
    if baseline_first:
        measure_no_cache(a, prompt_a, samples)
    measure_cold(a, client, prompt_a, block_size, samples)
    if not baseline_first:
        measure_no_cache(a, prompt_a, samples)
    measure_warm(b, client, prompt_b, block_size, samples)


def warm_up(stubs: list[pb_grpc.GeneratorStub], rng: np.random.Generator) -> None:
    """One full-length uncached request per worker, so the first measured run pays no start-up cost."""
    prompt = random_ids(rng, PREFIX_TOKENS + QUESTION_TOKENS)
    for stub in stubs:
        generate(stub, prompt, skip_cache=True)


def measure_block_size(model: Path, redis_server: RedisServer, block_size: int, runs: int) -> Row:
    """Starts workers A and B with ``block_size`` on a flushed Redis, runs the benchmark, stops them."""
    args = ("--cache", redis_server.url, "--block-size", str(block_size), "--intra-op-threads", str(INTRA_OP_THREADS))
    rng = np.random.default_rng(SEED)  # the same prompts for every block size
    samples = Samples()
    with ExitStack() as stack:
        client = stack.enter_context(redis_server.client())
        client.flushdb()
        workers = [stack.enter_context(WorkerProcess(model, *args)) for _ in range(2)]
        a, b = (pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(w.target))) for w in workers)
        warm_up([a, b], rng)
        for run in range(runs):
            # Alternate which of A's two requests comes first, so neither always follows B's.
            run_once(a, b, client, block_size, rng, run % 2 == 0, samples)
    return Row.from_samples(block_size, samples)


def print_table(rows: list[Row], runs: int) -> None:
    print(f"\nprefix {PREFIX_TOKENS} + question {QUESTION_TOKENS} tokens, max_new_tokens=1, "
          f"{INTRA_OP_THREADS} intra-op threads; medians of {runs} runs, server-side ms")
    header = ("block", "cached", "cold TTFT", "no-cache TTFT", "warm TTFT", "fetch ms", "warm/cold", "cold/no-cache")
    print("  ".join(f"{h:>13}" for h in header))
    for r in rows:
        values = (r.block_size, r.cached_tokens, r.cold_ttft, r.no_cache_ttft, r.warm_ttft, r.warm_fetch,
                  r.warm_ttft / r.cold_ttft, r.cold_ttft / r.no_cache_ttft)
        print("  ".join(f"{v:>13.2f}" if isinstance(v, float) else f"{v:>13}" for v in values))


def main(runs: int = RUNS) -> int:
    model = ensure_model(MODEL_DIR, "bench")
    rows = []
    with RedisServer() as redis_server:
        for block_size in BLOCK_SIZES:
            started = time.perf_counter()
            rows.append(measure_block_size(model, redis_server, block_size, runs))
            print(f"block size {block_size}: done in {time.perf_counter() - started:.1f} s", flush=True)
    print_table(rows, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
