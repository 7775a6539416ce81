"""What the cache costs a request it cannot help: cold TTFT with the cache on (empty store:
hashing, a missed lookup, publishing after the first token) against the cache off
(``skip_read`` + ``skip_write``), on one worker with Redis, interleaved, fresh prompts each run.

    .venv/bin/python -m bench.overhead [--smoke]
"""

from __future__ import annotations

import sys

import numpy as np

from bench.fleet import (
    bench_model,
    cold,
    first_token,
    fleet,
    median,
    parse_args,
    print_table,
    warm_up,
)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    prompt_tokens, runs = (256, 3) if args.smoke else (2080, 9)
    rng = np.random.default_rng(1)
    on_ms, off_ms = [], []
    with fleet(model, replicas=1) as f:
        (stub,) = f.stubs
        warm_up(f.stubs, model.random_ids(rng, prompt_tokens))
        for run in range(runs):
            # Alternate the order so that neither side always runs right after the other.
            for cache_on in ((True, False) if run % 2 == 0 else (False, True)):
                prompt = model.random_ids(rng, prompt_tokens)
                if cache_on:
                    on_ms.append(cold(f, stub, prompt).timings.time_to_first_token_ms)
                else:
                    off_ms.append(first_token(stub, prompt, skip_cache=True).timings.time_to_first_token_ms)
    rows = [(prompt_tokens, median(on_ms), median(off_ms), median(on_ms) / median(off_ms))]
    print_table(f"{model.name} model, one worker on Redis, block {f.block_size}; medians of {runs} runs",
                ("prompt tokens", "cache on (cold) TTFT ms", "cache off TTFT ms", "on/off"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
