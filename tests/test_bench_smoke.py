"""Each benchmark still runs end to end (tiny model, few runs): checks that they work, not their
numbers, so they cannot rot between the runs recorded in docs/benchmarks.md. bench/gpu.py is not
among them (it needs a GPU, which CI never has; scripts/gpu_check.sh runs it): here it only has to
refuse a machine without one in one line."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.local.model_cache import cache_dir, ensure_model
from services.local.model_catalogue import fetch_model

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.subprocess
BENCHES = ["ttft", "fetch", "decode", "overhead", "block_size", "batch", "load", "reliability", "stalls", "signing",
           "attacks", "samples", "turns", "cache_dtype", "route", "burst", "whisper", "http", "step_profile"]
PLOTTED = ("ttft", "batch")
SMOKE_FLAGS = {"whisper": ["--no-peer"]}
"""bench.whisper measures kvshare alone here: faster-whisper's own environment (~450 MB) is for real
runs, never a test's download (its Whisper folder, a 70 MB wheel converted, is fetched as the real
model tests fetch theirs)."""
AT_ONCE = 2
"""Smoke runs side by side: most of one is process start-up and waiting on its own servers."""
HANG_S = 900
"""A smoke run still going after this long is taken for hung (a hang guard, not a verdict: the longest,
bench.attacks, takes about 70 s alone on 2 CPUs, and several times that beside the rest of the suite)."""


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> dict:
    """The smoke run of every benchmark this session selected, ``AT_ONCE`` at a time, each its own
    process, its own servers and ports. The tiny model they all serve is built first, here, by
    the function they use, so that no two runs build it at once (and the Whisper folder, so that
    its download and conversion never count against a run's timeout)."""
    wanted = [item.callspec.params["bench"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")]
    ensure_model(cache_dir() / "decoder-tiny", "tiny")
    if "whisper" in wanted:
        fetch_model("whisper-tiny.en")
    folder = tmp_path_factory.mktemp("bench-plots")

    def run(bench: str) -> tuple[subprocess.CompletedProcess, Path]:
        plot = folder / f"{bench}.png"
        extra = (["--plot", str(plot)] if bench in PLOTTED else []) + SMOKE_FLAGS.get(bench, [])
        command = [sys.executable, "-m", f"bench.{bench}", "--smoke", *extra]
        try:
            return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S), plot
        except subprocess.TimeoutExpired as hung:
            # That benchmark's test fails with what it printed before it hung; the others still run.
            said = [part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                    for part in (hung.stdout, hung.stderr)]
            return subprocess.CompletedProcess(command, None, *said), plot

    with ThreadPoolExecutor(AT_ONCE) as pool:
        return dict(zip(wanted, pool.map(run, wanted), strict=True))


@pytest.mark.parametrize("bench", BENCHES)
def test_benchmark_smoke_run(bench, smoke_runs):
    proc, plot = smoke_runs[bench]
    assert proc.returncode is not None, f"hung for {HANG_S} s: " + proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "|---:|" in proc.stdout, "prints its table"
    if bench in PLOTTED:
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_gpu_benchmark_refuses_a_machine_without_a_gpu():
    """No GPU visible (CUDA_VISIBLE_DEVICES empty hides any there is): one line and exit 2, before it
    builds or starts anything."""
    proc = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("bench.gpu: no GPU to measure on: ")
