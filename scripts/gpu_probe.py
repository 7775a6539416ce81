"""What this machine offers kvshare on CUDA, for scripts/gpu_check.sh.

First, the two things every later step stands on, each failure in one line: CuPy compiles and runs a
kernel (``(arange(4, float16) + 1).get()``: NVRTC, which needs CUDA's runtime headers), and ONNX
Runtime makes a session on its CUDA provider and runs it (not the CPU session it falls back to when
the provider's libraries are missing). Then: whether a worker can use CUDA device 0 (the worker's own
check, ``device_arrays.cuda_problem``), the GPUs CuPy sees, ONNX Runtime's providers and where its
module comes from, and whether every installed requirement of kvshare (its base dependencies and the
gpu extra, from pyproject.toml) is in range; with ``--bench``, ONNX Runtime GenAI's CUDA build and the
redis-server binary too.

``--not-required`` names requirements whose versions are only reported: the machine's own (CuPy,
numpy, NVIDIA's CUDA wheels: the kernel above proves them by use) and, in the check's first stage,
what its second brings.

Prints one JSON object on stdout, each problem on stderr, and exits 1 when there is any: a machine
with a problem here would fail the CUDA tests for a reason that is not kvshare's.

    python scripts/gpu_probe.py [--bench] [--not-required NAME,NAME...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Problem(Exception):
    """A finding that stops the check, said in one line."""


def one_line(exc: BaseException) -> str:
    """An exception as one line (NVRTC's and ONNX Runtime's messages span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def cupy_kernel() -> dict:
    """A float16 elementwise kernel compiled by NVRTC and run: what a worker's first prefill does."""
    import cupy

    try:
        got = (cupy.arange(4, dtype=cupy.float16) + 1).get()
    except Exception as exc:  # noqa: BLE001 - NVRTC and CUDA errors come as several types
        said = one_line(exc)
        if "nvrtc" in said.lower() or type(exc).__name__ == "CompileException":
            said += (": NVRTC needs CUDA's runtime headers (cuda_fp16.h: the nvidia-cuda-runtime and nvidia-cuda-crt "
                     "wheels, or a CUDA toolkit)")
        raise Problem(f"CuPy cannot compile and run a kernel: {said}") from None
    if got.tolist() != [1.0, 2.0, 3.0, 4.0]:
        raise Problem(f"CuPy's kernel computed {got.tolist()} for arange(4) + 1")
    return {"cupy": cupy.__version__, "kernel": got.tolist()}


def add_one_model(width: int = 8) -> bytes:
    """``y = x + 1`` over float16 ``[1, width]`` (tests/gpu/test_cuda_binding.py binds rows of it)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "add_one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, width])],
        # From the array: make_tensor would take float16 bit patterns as values (1.0 became 15360).
        [numpy_helper.from_array(np.ones(1, np.float16), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def cuda_session() -> dict:
    """An ONNX Runtime session on CUDA device 0 that runs, as a worker opens one (``enable_fallback=0``,
    CUDA's pip libraries preloaded by ``cuda_problem``)."""
    import numpy as np

    from services.runtime.device_arrays import cuda_problem, cuda_provider_failure
    from services.runtime.ort import onnxruntime as ort

    if problem := cuda_problem(0):
        raise Problem(f"a worker cannot use cuda:0: {problem}")
    try:
        session = ort.InferenceSession(add_one_model(), providers=["CUDAExecutionProvider"], enable_fallback=0)
        got = session.run(None, {"x": np.arange(8, dtype=np.float16).reshape(1, 8)})[0]
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own pybind types
        raise Problem(f"ONNX Runtime cannot run a session on CUDA: {one_line(exc)}") from None
    if (provider := session.get_providers()[0]) != "CUDAExecutionProvider":
        raise Problem(f"ONNX Runtime made its session on {provider}, not CUDA: {cuda_provider_failure()}")
    if got.tolist() != [[float(i + 1) for i in range(8)]]:
        raise Problem(f"ONNX Runtime's CUDA session computed {got.tolist()} for arange(8) + 1")
    return {"providers": session.get_providers()}


def requirement_problems(not_required: set[str]) -> tuple[dict[str, str], list[str]]:
    """Installed versions of kvshare's runtime requirements (for this interpreter), and those missing
    or out of range, but for ``not_required``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, problems = {}, []
    for line in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": "gpu"}):
            continue
        required = canonicalize_name(requirement.name) not in not_required
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            found[requirement.name] = None
            if required:
                problems.append(f"{requirement.name} is not installed ({requirement})")
            continue
        found[requirement.name] = version
        if required and not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name} {version} is installed, kvshare needs {requirement}")
    return found, problems


def onnx_runtime(problems: list[str]) -> dict:
    """The ``onnxruntime`` module that imports must be onnxruntime-gpu's; a CPU onnxruntime beside it
    (the machine's own) is fine as long as it is shadowed."""
    import onnxruntime

    module = Path(onnxruntime.__file__).resolve().parent
    gpu_build = importlib.metadata.distribution("onnxruntime-gpu")
    if Path(gpu_build.locate_file("onnxruntime")).resolve() != module:
        problems.append(f"`import onnxruntime` loads {module}, not onnxruntime-gpu's: put its folder first on PYTHONPATH")
    return {"version": onnxruntime.__version__, "module": str(module), "providers": onnxruntime.get_available_providers()}


def gpus(problems: list[str]) -> dict:
    import cupy

    devices = []
    for index in range(cupy.cuda.runtime.getDeviceCount()):
        properties = cupy.cuda.runtime.getDeviceProperties(index)
        devices.append({"name": properties["name"].decode(), "memory_bytes": properties["totalGlobalMem"],
                        "compute_capability": f"{properties['major']}.{properties['minor']}"})
    return {"cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "devices": devices}


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true",
                        help="also what bench/gpu.py needs: GenAI's CUDA build, redis-server")
    parser.add_argument("--not-required", default="",
                        help="requirements whose versions are only reported, comma-separated")
    args = parser.parse_args()
    found: dict = {"python": sys.version.split()[0]}
    problems: list[str] = []
    for name, first in (("cupy_kernel", cupy_kernel), ("cuda_session", cuda_session)):
        try:
            found[name] = first()
        except Problem as problem:
            problems.append(str(problem))
        except Exception as exc:  # noqa: BLE001 - an import that fails is this part's problem too
            problems.append(f"{name}: {one_line(exc)}")
    not_required = {canonicalize_name(name) for name in args.not_required.split(",") if name}
    found["requirements"], missing = requirement_problems(not_required)
    problems += missing
    rest = [("gpu", gpus), ("onnxruntime", onnx_runtime)]
    if args.bench:
        rest += [("onnxruntime_genai", genai), ("redis_server", redis_server)]
    for name, probe in rest:
        try:
            found[name] = probe(problems)
        except Exception as exc:  # noqa: BLE001 - any failure is reported as this part's problem
            problems.append(f"{name}: {one_line(exc)}")
    found["problems"] = problems
    print(json.dumps(found))
    for problem in problems:
        print(f"gpu_probe: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
