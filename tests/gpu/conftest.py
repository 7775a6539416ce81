"""Tests that need a GPU: every test under tests/gpu/ is marked ``cuda`` and, where CUDA device 0
cannot run a worker (``device_arrays.cuda_problem``: no CUDA provider in ONNX Runtime, no CuPy, no
GPU; CI and every machine without one), skipped with that reason, so the suite collects them
everywhere and runs them where they can run (scripts/gpu_check.sh).

Under scripts/gpu_check.sh (``KVSHARE_GPU_CHECK=1``) a missing GPU or provider is a usage error
instead of a skip: there, a skipped test would hide exactly the failure the check is for.

Conventions for the modules here, since tests/ has no ``__init__.py`` (pytest imports each test
module by its file name): names unique across tests/ (``test_cuda_*.py``), and CuPy imported inside
tests and fixtures only, never at module level: CI has no CuPy, and a module that fails to import
is a collection error there, not a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.runtime.device_arrays import cuda_problem

HERE = Path(__file__).resolve().parent
REQUIRE = "KVSHARE_GPU_CHECK"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with the whole session's items, not only this folder's; first, so that `-m cuda`
    # selects on the marker added here.
    ours = [item for item in items if HERE in item.path.parents]
    if not ours:
        return
    for item in ours:
        item.add_marker(pytest.mark.cuda)
    reason = cuda_problem(0)
    if reason is None:
        return
    if os.environ.get(REQUIRE) == "1":
        raise pytest.UsageError(f"{REQUIRE}=1 and {len(ours)} CUDA tests collected, but {reason}")
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=f"no CUDA here: {reason}"))
