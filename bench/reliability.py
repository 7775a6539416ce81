"""One table of every fault case (bench/faults.py) and load case (bench/load.py) from one run, as
docs/reliability.md shows it: requests sent, not OK by status, wrong answers, and what was seen.

    .venv/bin/python -m bench.reliability [--smoke]
"""

from __future__ import annotations

import sys

from bench import faults, load
from bench.fleet import bench_model, parse_args, print_table


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args.smoke)
    with faults.lab(model, faults.workload_for(model, args.smoke)) as lab:
        fault_results = [lab.run(name, faults.settle_for(args.smoke)) for name in faults.CASES]
    load_results = load.run_load(model, args.smoke, streams=8 if args.smoke else 64,
                                 seconds=3.0 if args.smoke else 60.0, burst_size=200 if args.smoke else 1000)
    rows = [(r.name, r.injected, r.summary.sent, r.summary.failed_text, r.summary.wrong, f"the workers saw {r.seen_text}")
            for r in fault_results]
    rows += [(r.name, r.conditions, r.summary.sent, r.summary.failed_text, r.summary.wrong,
              f"TTFT p50 {r.summary.ttft_p50_ms:.0f} ms, p99 {r.summary.ttft_p99_ms:.0f} ms; "
              f"{r.summary.tokens_per_s:.0f} tokens/s; "
              + (f"slowest refusal {r.refused_ms:.0f} ms; " if r.refused_ms else "")
              + f"worker RSS {r.rss.text} MiB") for r in load_results]
    print_table(f"Reliability, model {model.preset}", ("case", "conditions", "requests", "not OK, by status", "wrong", "notes"),
                rows)
    held = all(r.held for r in fault_results) and all(r.held for r in load_results)
    if not held:
        print("\nFAILED: a request failed or answered wrong (see the table)", file=sys.stderr)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
