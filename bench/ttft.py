"""Time to first token against shared-prefix length, cold (nothing cached) and warm (the prefix
published by the other replica), with the bench model on two workers sharing one Redis.

For each prefix length, each run takes a fresh prefix plus a 32-token question: worker A computes
it (cold) and publishes its blocks; worker B gets the same prefix with another question (warm) and
fetches the prefix's full blocks. Medians of server-side ms; writes docs/ttft.png.

With ``--model`` a folder with a chat template (e.g. SmolLM2 from `kvshare fetch-model`) also gets
a row for the demo's case: the demo's support manual as system message, a different question on
each replica (a fresh first line per run, so that each cold run is cold).

A last table compares a fresh replica's first warm request with its later ones: two new workers
per fleet, B's first request ever fetching a prefix A computed.

    .venv/bin/python -m bench.ttft [--smoke] [--model DIR] [--plot PATH] [--cache-dtype float32|float16|bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.fleet import (
    QUESTION_TOKENS,
    Fleet,
    bench_model,
    cold,
    fleet,
    median,
    parse_args,
    print_table,
    warm,
    warm_up,
)
from cachestore.storage_dtype import CHOICES, DEFAULT
from kvshare.v1 import generator_pb2 as pb
from services.local.demo import QUESTIONS, system_prompt
from services.runtime.chat_template import load_chat_template

DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "docs" / "ttft.png"
FIRST_WARM_TOKENS = 1216
"""The demo's shared system prompt, in SmolLM2 tokens: the case of a new user's first warm request."""


def demo_manual_row(f: Fleet, runs: int) -> tuple:
    """(system message tokens, cold ms, warm ms, warm fetch ms, warm/cold) for the demo's manual."""
    cold_ms, warm_ms, fetch_ms = [], [], []
    a, b = f.stubs
    for run in range(runs):
        system = pb.ChatMessage(role="system", content=f"Session {run}.\n{system_prompt()}")

        def ids(question: str) -> list[int]:
            user = pb.ChatMessage(role="user", content=question)
            return list(a.Tokenize(pb.TokenizeRequest(messages=[system, user])).token_ids)

        first, second = ids(QUESTIONS[0]), ids(QUESTIONS[1])
        shared = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
        cold_ms.append(cold(f, a, first).timings.time_to_first_token_ms)
        w = warm(f, b, second, shared // f.block_size * f.block_size)
        warm_ms.append(w.timings.time_to_first_token_ms)
        fetch_ms.append(w.timings.cache_fetch_ms)
    return shared, median(cold_ms), median(warm_ms), median(fetch_ms), median(warm_ms) / median(cold_ms)


def first_warm_rows(model, rng: np.random.Generator, extra_args: tuple[str, ...], length: int, fleets: int,
                    steady: int) -> list[tuple]:
    """A fresh replica's first warm request against its later ones: per fleet (two new workers),
    worker A computes a ``length``-token prefix and B, which has served nothing yet, fetches it;
    then ``steady`` more prefixes the same way. Rows (which, TTFT ms, fetch ms) of the medians."""
    first_ttft, first_fetch, steady_ttft, steady_fetch = [], [], [], []
    for _ in range(fleets):
        with fleet(model, extra_args=extra_args) as f:
            a, b = f.stubs
            warm_up([a], model.random_ids(rng, length + QUESTION_TOKENS))
            for i in range(1 + steady):
                prefix = model.random_ids(rng, length)
                cold(f, a, prefix + model.random_ids(rng, QUESTION_TOKENS))
                w = warm(f, b, prefix + model.random_ids(rng, QUESTION_TOKENS), length // f.block_size * f.block_size)
                ttft, fetch = (first_ttft, first_fetch) if i == 0 else (steady_ttft, steady_fetch)
                ttft.append(w.timings.time_to_first_token_ms)
                fetch.append(w.timings.cache_fetch_ms)
    return [("first warm (a fresh replica's first request)", median(first_ttft), median(first_fetch)),
            ("warm (its later ones)", median(steady_ttft), median(steady_fetch)),
            ("first / later", median(first_ttft) / median(steady_ttft), median(first_fetch) / median(steady_fetch))]


def plot(rows: list[tuple], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(lengths, [r[1] for r in rows], "o-", label="cold (computes the prefix)")
    ax.plot(lengths, [r[2] for r in rows], "o-", label="warm (other replica's blocks)")
    ax.bar(lengths, [r[3] for r in rows], width=[max(lengths) / 40] * len(rows), color="tab:green", alpha=0.5,
           label="of which fetch (Redis + checks + assembly)")
    ax.set_xlabel("shared prefix tokens (+32-token question)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plot", type=Path, default=None)
        parser.add_argument("--cache-dtype", choices=list(CHOICES), default=DEFAULT,
                            help="the workers' --cache-dtype (default: the worker's default)")

    args = parse_args(__doc__.splitlines()[0], options)
    model = bench_model(args)
    lengths, runs = ((64, 128, 256), 2) if args.smoke else ((256, 512, 1024, 2048, 3072), 5)
    rng = np.random.default_rng(0)
    rows, demo_row = [], None
    with fleet(model, extra_args=("--cache-dtype", args.cache_dtype)) as f:
        a, b = f.stubs
        warm_up(f.stubs, model.random_ids(rng, max(lengths) + QUESTION_TOKENS))
        for length in lengths:
            cold_ms, warm_ms, fetch_ms = [], [], []
            for _ in range(runs):
                prefix = model.random_ids(rng, length)
                cold_ms.append(cold(f, a, prefix + model.random_ids(rng, QUESTION_TOKENS)).timings.time_to_first_token_ms)
                w = warm(f, b, prefix + model.random_ids(rng, QUESTION_TOKENS), length // f.block_size * f.block_size)
                warm_ms.append(w.timings.time_to_first_token_ms)
                fetch_ms.append(w.timings.cache_fetch_ms)
            rows.append((length, median(cold_ms), median(warm_ms), median(fetch_ms), median(warm_ms) / median(cold_ms)))
            print(f"prefix {length}: cold {rows[-1][1]:.1f} ms, warm {rows[-1][2]:.1f} ms", flush=True)
        if load_chat_template(model.folder) is not None:
            demo_row = demo_manual_row(f, runs)
            print(f"demo manual: cold {demo_row[1]:.1f} ms, warm {demo_row[2]:.1f} ms", flush=True)
    title = (f"{model.name} model, 2 replicas on one Redis, block {f.block_size}, {args.cache_dtype} K/V in the store; "
             f"medians of {runs} runs")
    table = rows + ([("demo manual " + str(demo_row[0]), *demo_row[1:])] if demo_row else [])
    print_table(title, ("prefix tokens", "cold TTFT ms", "warm TTFT ms", "warm fetch ms", "warm/cold"), table)
    plot(rows, args.plot or DEFAULT_PLOT, title)
    print(f"\nplot: {args.plot or DEFAULT_PLOT}")
    length, fleets, steady = (128, 1, 1) if args.smoke else (FIRST_WARM_TOKENS, 3, 3)
    first = first_warm_rows(model, rng, ("--cache-dtype", args.cache_dtype), length, fleets, steady)
    print_table(f"a fresh replica: {length}-token prefix + {QUESTION_TOKENS}-token question, {fleets} fleets of two new "
                f"workers, {steady} later requests each; medians", ("request", "TTFT ms", "fetch ms"), first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
