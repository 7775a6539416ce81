"""Faults in the shared store under live traffic (the cases of ``services/local/store_faults.py``,
which ``bench/faults.py`` measures, on the tiny model): a killed, paused or full Redis, damaged or
swapped values, connections cut inside a fetch. Every request must succeed with the tokens of the
same prompt computed cold, and the workers' metrics must show that the fault reached them. Steps
wait on finished requests, not on time."""

from __future__ import annotations

import pytest

from services.local.store_faults import CASES, lab, settle_for, workload_for
from services.runtime.model_spec import load_model_spec

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def fault_lab(tiny_model):
    with lab(tiny_model, workload_for(load_model_spec(tiny_model).vocab_size, smoke=True)) as the_lab:
        yield the_lab


@pytest.mark.parametrize("name", list(CASES))
def test_no_request_fails_or_differs_under_the_fault(fault_lab, name):
    result = fault_lab.run(name, settle_for(smoke=True))
    assert not result.summary.failed, f"failed requests: {result.summary.failed_text}"
    assert result.summary.wrong == 0, f"{result.summary.wrong} of {result.summary.sent} answers differ from cold"
    assert result.seen[CASES[name].sign] > 0, f"the fault never reached the workers (they saw {result.seen_text})"
