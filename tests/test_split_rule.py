"""The split rule's runs: they cover exactly the positions asked for, contiguously, begin at
most one held position early, and none has a lone length (``split_rule``)."""

from __future__ import annotations

import pytest

from services.runtime.numerics_probe import fitting_rule
from services.runtime.split_rule import EVERY_RUN, SplitRule


@pytest.mark.parametrize("moduli", [(128,), (64, 128), (128, 640), (8, 128), (3, 128)])
def test_runs_cover_the_positions_without_a_lone_length(moduli):
    rule = SplitRule(moduli)
    for start in (0, 1, 2, 63, 64, 128, 1000):
        for n in range(1, 700):
            runs = rule.runs(start, n)
            assert runs[-1][1] == start + n and start - 1 <= runs[0][0] <= start
            assert runs[0][0] == start or start > 0
            assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
            lone = [end - begin for begin, end in runs if rule.lone(end - begin)]
            assert not lone or (start == 0 and n == 1), (start, n, runs)


def test_every_run_is_one_run():
    assert EVERY_RUN.runs(5, 129) == [(5, 134)]
    assert EVERY_RUN.runs(0, 1) == [(0, 1)]


def test_a_lone_run_begins_one_held_position_early_or_splits_at_the_start():
    rule = SplitRule((128,))
    assert rule.runs(256, 1) == [(255, 257)]
    assert rule.runs(256, 129) == [(255, 385)]
    assert rule.runs(0, 129) == [(0, 127), (127, 129)]
    assert rule.runs(0, 130) == [(0, 130)]


def test_the_fitted_rule_covers_what_was_measured_or_there_is_none():
    assert fitting_rule((1, 129, 257)).moduli == (128,)
    assert fitting_rule((1, 65, 129)).moduli == (64, 128)
    assert fitting_rule((1,)).moduli == (128,)
    assert fitting_rule(()).moduli == (128,)
    assert fitting_rule((1, 2, 5)) is None  # no period explains 5
