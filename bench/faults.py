"""Faults in the shared store under live traffic, one table: every request must still succeed,
with the same tokens as the same prompt computed cold. The cases and their lab (two workers on one
redis-server behind a TCP proxy, eight clients) are in ``services/local/store_faults.py``, which
the regression tests (tests/faults/) run too. The "the workers saw" column is the change in the
workers' own metrics (store errors by kind, values rejected by reason): proof that the fault
reached them.

    .venv/bin/python -m bench.faults [--smoke]
"""

from __future__ import annotations

import sys

from bench.fleet import INTRA_OP_THREADS, bench_model, parse_args, print_table, verdict
from services.local.store_faults import (
    CASES,
    CLIENTS,
    CaseResult,
    lab,
    settle_for,
    workload_for,
)


def table_rows(results: list[CaseResult]) -> list[tuple]:
    return [(r.name, r.injected, r.summary.sent, r.summary.failed_text, r.summary.wrong, r.seen_text) for r in results]


HEADER = ("case", "fault injected", "requests", "failed", "wrong", "the workers saw")


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    with lab(model.folder, workload_for(model.vocab_size, args.smoke), INTRA_OP_THREADS) as the_lab:
        results = [the_lab.run(name, settle_for(args.smoke)) for name in CASES]
    print_table(f"Faults under {CLIENTS} clients, 2 workers, model {model.name}", HEADER, table_rows(results))
    return verdict(results, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
