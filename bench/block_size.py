"""Which cache block size (``--block-size``): warm and cold TTFT for 16, 64, 128 and 256 tokens.

For each block size, two workers A and B share one Redis. Each run takes a fresh 2048-token prefix
and a 32-token question: A computes it without the cache (baseline) and with it (cold, publishing
its blocks), then B gets the same prefix with another question (warm). Medians of server-side ms.

    .venv/bin/python -m bench.block_size [--smoke]
"""

from __future__ import annotations

import sys

import numpy as np

from bench.fleet import (
    QUESTION_TOKENS,
    bench_model,
    cold,
    first_token,
    fleet,
    median,
    parse_args,
    print_table,
    warm,
    warm_up,
)
from services.local.redis_process import RedisServer


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    block_sizes, prefix_tokens, runs = ((16, 64), 128, 2) if args.smoke else ((16, 64, 128, 256), 2048, 5)
    rows = []
    with RedisServer() as server:
        for block_size in block_sizes:
            rng = np.random.default_rng(0)  # the same prompts for every block size
            baseline, cold_ms, warm_ms, fetch_ms = [], [], [], []
            with fleet(model, block_size=block_size, redis_server=server) as f:
                a, b = f.stubs
                warm_up(f.stubs, model.random_ids(rng, prefix_tokens + QUESTION_TOKENS))
                for run in range(runs):
                    prefix = model.random_ids(rng, prefix_tokens)
                    prompt_a = prefix + model.random_ids(rng, QUESTION_TOKENS)
                    prompt_b = prefix + model.random_ids(rng, QUESTION_TOKENS)
                    # Alternate which of A's two requests comes first, so neither always follows B's.
                    if run % 2 == 0:
                        baseline.append(first_token(a, prompt_a, skip_cache=True).timings.time_to_first_token_ms)
                    cold_ms.append(cold(f, a, prompt_a).timings.time_to_first_token_ms)
                    if run % 2 == 1:
                        baseline.append(first_token(a, prompt_a, skip_cache=True).timings.time_to_first_token_ms)
                    w = warm(f, b, prompt_b, prefix_tokens // block_size * block_size)
                    warm_ms.append(w.timings.time_to_first_token_ms)
                    fetch_ms.append(w.timings.cache_fetch_ms)
            rows.append((block_size, median(cold_ms), median(baseline), median(warm_ms), median(fetch_ms),
                         median(warm_ms) / median(cold_ms), median(cold_ms) / median(baseline)))
            print(f"block size {block_size} done", flush=True)
    print_table(
        f"{model.name} model, prefix {prefix_tokens} + question {QUESTION_TOKENS} tokens; medians of {runs} runs, server-side ms",
        ("block", "cold TTFT", "no-cache TTFT", "warm TTFT", "fetch ms", "warm/cold", "cold/no-cache"), rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
