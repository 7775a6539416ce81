"""Each benchmark still runs end to end (tiny model, few runs): checks that they work, not their
numbers, so they cannot rot between the runs recorded in docs/benchmarks.md."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.subprocess


@pytest.mark.parametrize("bench", ["ttft", "fetch", "decode", "overhead", "block_size", "batch", "load", "reliability",
                                   "stalls", "signing", "attacks", "samples", "turns", "cache_dtype",
                                   "route", "burst"])
def test_benchmark_smoke_run(bench, tmp_path):
    extra = ["--plot", str(tmp_path / f"{bench}.png")] if bench in ("ttft", "batch") else []
    proc = subprocess.run([sys.executable, "-m", f"bench.{bench}", "--smoke", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "|---:|" in proc.stdout, "prints its table"
    if bench in ("ttft", "batch"):
        assert (tmp_path / f"{bench}.png").read_bytes()[:4] == b"\x89PNG"
