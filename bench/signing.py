"""What signed cache values cost on the warm path: warm time to first token with and without a
signing key, side by side in one run (two replicas each, one Redis), at several prefix lengths.

Each run takes a fresh prefix plus a 32-token question: worker A computes it (cold) and publishes;
worker B gets the prefix with another question (warm), fetching and verifying every block. The
unsigned and the signed fleets alternate run by run, so drift hits both alike. The target: warm
TTFT signed within 10% of unsigned at 2048 tokens.

    .venv/bin/python -m bench.signing [--smoke] [--model DIR] [--runs N]
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.fleet import (
    QUESTION_TOKENS,
    bench_model,
    cold,
    fleet,
    median,
    parse_args,
    print_table,
    warm,
    warm_up,
)
from kvshare.v1 import generator_pb2 as pb
from services.local.redis_process import RedisServer

TARGET_LENGTH, TARGET_RATIO = 2048, 1.10


@dataclass(slots=True)
class Row:
    length: int
    unsigned_ms: float
    signed_ms: float
    unsigned_fetch_ms: float
    signed_fetch_ms: float

    @property
    def ratio(self) -> float:
        return self.signed_ms / self.unsigned_ms


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--runs", type=int, default=9))
    model = bench_model(args)
    lengths, runs = ((64, 128), 2) if args.smoke else ((512, 1024, TARGET_LENGTH, 3072), args.runs)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        keys = Path(tmp) / "signing-keys"
        keys.write_text(f"bench {rng.bytes(32).hex()}\n")
        with (fleet(model, redis_server=server) as unsigned,
              fleet(model, redis_server=server, extra_args=("--cache-signing-key-file", str(keys))) as signed):
            fleets = {"unsigned": unsigned, "signed": signed}
            for f in fleets.values():
                warm_up(f.stubs, model.random_ids(rng, max(lengths) + QUESTION_TOKENS))
            info = unsigned.stubs[0].GetModelInfo(pb.GetModelInfoRequest())
            rows = []
            for length in lengths:
                ttft: dict[str, list[float]] = {name: [] for name in fleets}
                fetch: dict[str, list[float]] = {name: [] for name in fleets}
                for _ in range(runs):
                    for name, f in fleets.items():
                        a, b = f.stubs
                        prefix = model.random_ids(rng, length)
                        cold(f, a, prefix + model.random_ids(rng, QUESTION_TOKENS))
                        w = warm(f, b, prefix + model.random_ids(rng, QUESTION_TOKENS), length // f.block_size * f.block_size)
                        ttft[name].append(w.timings.time_to_first_token_ms)
                        fetch[name].append(w.timings.cache_fetch_ms)
                rows.append(Row(length, median(ttft["unsigned"]), median(ttft["signed"]),
                                median(fetch["unsigned"]), median(fetch["signed"])))
                print(f"prefix {length}: warm unsigned {rows[-1].unsigned_ms:.1f} ms, signed {rows[-1].signed_ms:.1f} ms",
                      flush=True)
    mib = info.kv_bytes_per_token * TARGET_LENGTH / 2**20
    title = (f"{model.name} model ({info.kv_bytes_per_token} K/V bytes per token: {mib:.1f} MiB at {TARGET_LENGTH} tokens), "
             f"warm TTFT, keyed BLAKE3 signing vs none; medians of {runs} interleaved runs")
    print_table(title, ("prefix tokens", "unsigned warm ms", "signed warm ms", "unsigned fetch ms", "signed fetch ms",
                        "signed/unsigned"),
                [(r.length, r.unsigned_ms, r.signed_ms, r.unsigned_fetch_ms, r.signed_fetch_ms, r.ratio) for r in rows])
    target = next((r for r in rows if r.length == TARGET_LENGTH), None)
    if target is not None:
        held = target.ratio <= TARGET_RATIO
        print(f"\nat {TARGET_LENGTH} tokens signed/unsigned = {target.ratio:.3f} (target <= {TARGET_RATIO}): "
              f"{'held' if held else 'NOT held'}")
        return 0 if held else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
