"""The locks agree with pyproject.toml: every dependency it declares is pinned, at a version its
range allows, in the development lock (requirements/dev.txt, for each Python the project supports)
and in the images' locks (requirements/cpu.txt, gpu.txt), and a package both kinds of lock hold has
the same version in both, so the tests run what the images ship. scripts/lock.sh writes them."""

import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from dev_lock import DEV_LOCK, pinned, read_lock  # noqa: E402

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PYTHONS = ("3.11", "3.12", "3.13")
IMAGES = ("cpu", "gpu")


def environment(python: str) -> dict[str, str]:
    """Marker values of CPython ``python`` on linux x86_64 (the images', CI's and the README's)."""
    return {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}


def declared(*extras: str, build: bool = False) -> list[Requirement]:
    project = PROJECT["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    found += [Requirement(r) for extra in extras for r in project["optional-dependencies"][extra]]
    if build:
        found += [Requirement(r) for r in PROJECT["build-system"]["requires"]]
    return found


def disagreements(requirements: list[Requirement], pins: dict[str, str], env: dict[str, str]) -> list[str]:
    wrong = []
    for requirement in requirements:
        if requirement.marker is not None and not requirement.marker.evaluate(env):
            continue
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            wrong.append(f"{requirement} is not pinned")
        elif not requirement.specifier.contains(version, prereleases=True):
            wrong.append(f"{requirement} but the lock pins {version}")
    return wrong


@pytest.mark.parametrize("python", PYTHONS)
def test_the_development_lock_pins_every_declared_dependency(python):
    env = environment(python)
    wrong = disagreements(declared("cpu", "test", "local", build=True), pinned(DEV_LOCK, env), env)
    assert not wrong, f"requirements/dev.txt disagrees with pyproject.toml for Python {python} " \
                      f"(run bash scripts/lock.sh): {wrong}"


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_lock_pins_its_runtime_dependencies(image):
    env = environment("3.11")
    wrong = disagreements(declared(image), pinned(ROOT / "requirements" / f"{image}.txt", env), env)
    assert not wrong, f"requirements/{image}.txt disagrees with pyproject.toml (run bash scripts/lock.sh): {wrong}"


@pytest.mark.parametrize("image", IMAGES)
def test_the_tests_run_the_versions_the_images_ship(image):
    env = environment("3.11")
    dev, shipped = pinned(DEV_LOCK, env), pinned(ROOT / "requirements" / f"{image}.txt", env)
    differ = {name: (dev[name], version) for name, version in shipped.items() if name in dev and dev[name] != version}
    assert not differ, f"dev.txt and {image}.txt pin different versions (dev, image): {differ}"


def test_the_lowest_redis_py_allowed_is_the_one_the_tests_run():
    """cachestore/redis_budget.py overrides methods and properties of redis-py's connections: a
    release older than the pinned one was never tested, so pyproject.toml allows none."""
    redis = next(r for r in declared() if canonicalize_name(r.name) == "redis")
    lowest = [Version(spec.version) for spec in redis.specifier if spec.operator == ">="]
    assert lowest == [Version(pinned(DEV_LOCK, environment("3.11"))["redis"])], (
        f"{redis}: its lower bound is not the version requirements/dev.txt pins")


def test_every_pin_of_the_development_lock_is_hash_checked():
    lines = DEV_LOCK.read_text().splitlines()
    pins = read_lock(DEV_LOCK)
    assert len(pins) > 50
    starts = [i for i, line in enumerate(lines) if line and not line[0].isspace() and not line.startswith("#")]
    unhashed = [lines[i] for i in starts if i + 1 >= len(lines) or "--hash=sha256:" not in lines[i + 1]]
    assert not unhashed, unhashed


def test_this_environment_is_the_lock():
    """What scripts/venv.sh installed is what the lock pins (a venv built from another lock, or by hand,
    fails here rather than testing other software)."""
    from importlib import metadata

    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    want = pinned(DEV_LOCK)
    differ = {name: (installed.get(name), version) for name, version in want.items() if installed.get(name) != version}
    assert not differ, f"installed vs locked: {differ} (run bash scripts/venv.sh)"


def test_the_locks_are_written_by_the_uv_that_installs_them():
    """scripts/lock.sh runs the uv version the development lock pins (scripts/venv.sh installs with it)."""
    script = (ROOT / "scripts" / "lock.sh").read_text()
    written_by = next(line.split('"')[1] for line in script.splitlines() if line.startswith("uv_version="))
    assert pinned(DEV_LOCK)["uv"] == written_by


def test_the_gpu_image_carries_the_cuda_headers_cupy_compiles_with():
    """CuPy compiles its kernels at run time (NVRTC) and needs the CUDA runtime's headers, which
    NVIDIA's -runtime base image lacks: the gpu lock carries them as wheels of the same CUDA major
    as CuPy's build (cupy-cuda13x) and onnxruntime-gpu's (CUDA 13)."""
    pins = pinned(ROOT / "requirements" / "gpu.txt", environment("3.11"))
    cuda_major = next(name for name in pins if name.startswith("cupy-cuda")).removeprefix("cupy-cuda").removesuffix("x")
    for headers in ("nvidia-cuda-runtime", "nvidia-cuda-crt"):
        assert headers in pins, f"requirements/gpu.txt has no {headers}: CuPy could not compile a kernel"
        assert pins[headers].split(".")[0] == cuda_major, (headers, pins[headers], cuda_major)
