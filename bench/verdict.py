"""How a benchmark's verdict on its figures becomes its exit code.

A measured run fails (exit 1) when a figure misses what the benchmark promises: a latency bound, a
deadline met, a hit rate. A smoke run (``--smoke``: tiny model, few runs, on whatever machine the test
suite shares) exists to show that the benchmark still runs and reports those figures; its figures are
no result, so they never fail it: the verdict is printed and said to be unjudged. Verdicts that do not
depend on the clock (answers differing from a cold recompute, forged K/V served) do not come here:
they fail every run.
"""

from __future__ import annotations

import sys


def exit_code(held: bool, smoke: bool) -> int:
    """0 when ``held``; otherwise 1, or 0 in a smoke run after saying on stderr that it was not judged."""
    if held:
        return 0
    if smoke:
        print("smoke run: the figures above missed the benchmark's verdict, which a smoke run reports and "
              "does not judge (a measured run would exit 1)", file=sys.stderr)
        return 0
    return 1
