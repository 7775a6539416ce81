"""One table of every fault case (services/local/store_faults.py) and load case (bench/load.py) from one run, as
docs/reliability.md shows it: requests sent, not OK by status, wrong answers, and what was seen.

    .venv/bin/python -m bench.reliability [--smoke]
"""

from __future__ import annotations

import sys

from bench import load
from bench.fleet import INTRA_OP_THREADS, bench_model, parse_args, print_table, verdict
from services.local import store_faults


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    workload = store_faults.workload_for(model.vocab_size, args.smoke)
    with store_faults.lab(model.folder, workload, INTRA_OP_THREADS) as lab:
        fault_results = [lab.run(name, store_faults.settle_for(args.smoke)) for name in store_faults.CASES]
    load_results = load.run_load(model, args.smoke, *load.default_sizes(args.smoke))
    rows = [(r.name, r.injected, r.summary.sent, r.summary.failed_text, r.summary.wrong, f"the workers saw {r.seen_text}")
            for r in fault_results]
    rows += [(r.name, r.conditions, r.summary.sent, r.summary.failed_text, r.summary.wrong,
              f"TTFT p50 {r.summary.ttft_p50_ms:.0f} ms, p99 {r.summary.ttft_p99_ms:.0f} ms; "
              f"{r.summary.tokens_per_s:.0f} tokens/s; "
              + ("refusal p50 / p99 / max {:.0f} / {:.0f} / {:.0f} ms; ".format(*r.refused_ms) if r.refused_ms else "")
              + f"worker RSS {r.rss.text} MiB") for r in load_results]
    print_table(f"Reliability, model {model.name}", ("case", "conditions", "requests", "not OK, by status", "wrong", "notes"),
                rows)
    return verdict([*fault_results, *load_results], args.smoke)


if __name__ == "__main__":
    sys.exit(main())
