"""What this machine offers kvshare on CUDA, for scripts/gpu_check.sh: whether a worker can use CUDA
device 0 (the worker's own check, ``device_arrays.cuda_problem``), the GPUs CuPy sees, ONNX
Runtime's providers and where its module comes from, ONNX Runtime GenAI's build, the redis-server
binary, and whether every installed requirement of kvshare (its base dependencies and the gpu
extra, from pyproject.toml) is in range.

Prints one JSON object on stdout, each problem on stderr, and exits 1 when there is any: a
machine with a problem here would fail the CUDA tests for a reason that is not kvshare's.

    python scripts/gpu_probe.py
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def requirement_problems() -> tuple[dict[str, str], list[str]]:
    """Installed versions of kvshare's runtime requirements (for this interpreter), and those missing
    or out of range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, problems = {}, []
    for line in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": "gpu"}):
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed ({requirement})")
            continue
        found[requirement.name] = version
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name} {version} is installed, kvshare needs {requirement}")
    return found, problems


def onnx_runtime(problems: list[str]) -> dict:
    """The ``onnxruntime`` module that imports must be onnxruntime-gpu's, with the CUDA provider; a
    CPU onnxruntime beside it (the machine's own) is fine as long as it is shadowed."""
    import onnxruntime

    module = Path(onnxruntime.__file__).resolve().parent
    gpu_build = importlib.metadata.distribution("onnxruntime-gpu")
    if Path(gpu_build.locate_file("onnxruntime")).resolve() != module:
        problems.append(f"`import onnxruntime` loads {module}, not onnxruntime-gpu's: put its folder first on PYTHONPATH")
    return {"version": onnxruntime.__version__, "module": str(module), "providers": onnxruntime.get_available_providers()}


def gpus(problems: list[str]) -> dict:
    from services.runtime.device_arrays import cuda_problem

    if problem := cuda_problem(0):
        problems.append(f"a worker cannot use cuda:0: {problem}")
    import cupy

    count = cupy.cuda.runtime.getDeviceCount() if cupy.cuda.is_available() else 0
    devices = []
    for index in range(count):
        properties = cupy.cuda.runtime.getDeviceProperties(index)
        devices.append({"name": properties["name"].decode(), "memory_bytes": properties["totalGlobalMem"],
                        "compute_capability": f"{properties['major']}.{properties['minor']}"})
    return {"cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "devices": devices}


def genai(problems: list[str]) -> dict:
    import onnxruntime_genai as og

    if not og.is_cuda_available():
        problems.append(f"onnxruntime-genai {og.__version__} is not the CUDA build (onnxruntime-genai-cuda)")
    return {"version": og.__version__, "cuda": og.is_cuda_available()}


def redis_server(problems: list[str]) -> dict:
    from services.local.redis_process import redis_binary

    binary = redis_binary()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    if version.returncode:
        problems.append(f"{binary} --version failed: {version.stderr.strip()}")
    return {"binary": binary, "version": version.stdout.strip()}


def main() -> int:
    requirements, problems = requirement_problems()
    found: dict = {"python": sys.version.split()[0], "requirements": requirements}
    for name, probe in (("gpu", gpus), ("onnxruntime", onnx_runtime), ("onnxruntime_genai", genai),
                        ("redis_server", redis_server)):
        try:
            found[name] = probe(problems)
        except Exception as exc:  # noqa: BLE001 - any failure is reported as this part's problem
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    found["problems"] = problems
    print(json.dumps(found))
    for problem in problems:
        print(f"gpu_probe: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
