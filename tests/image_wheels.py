"""The wheels of the images' dependency locks (requirements/cpu.txt, requirements/gpu.txt), fetched by
the test set-up (scripts/test.sh) so that tests/test_images.py can build each image's Python
environment with no network. pip checks every wheel against the lock's hashes; a stamp next to the
wheels records which lock a folder completely holds, so a second run downloads nothing.

    .venv/bin/python tests/image_wheels.py     # fetch what is missing; prints each folder
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from pathlib import Path

from tools import tools_dir

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ("cpu", "gpu")
# The images' interpreter (CPython 3.11) and platform: both base images have glibc >= 2.28. pip takes
# each manylinux tag literally, so every older glibc level (and its legacy alias) is listed too.
MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
TARGET = ["--implementation", "cp", "--python-version", "3.11",
          *(arg for tag in MANYLINUX for arg in ("--platform", tag))]
STAMP = ".complete"


def lock_file(image: str) -> Path:
    return ROOT / "requirements" / f"{image}.txt"


def wheels_dir(image: str) -> Path:
    return tools_dir() / "wheels" / image


def _lock_digest(image: str) -> str:
    return hashlib.sha256(lock_file(image).read_bytes()).hexdigest()


def wheels_ready(image: str) -> bool:
    """True when the folder holds every wheel of the current lock (its stamp names the lock's hash)."""
    stamp = wheels_dir(image) / STAMP
    return stamp.exists() and stamp.read_text().strip() == _lock_digest(image)


def usable_here() -> bool:
    """The wheels only install into a CPython 3.11 on linux x86_64, the images' own interpreter."""
    return (sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11)
            and platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"))


def fetch_wheels(image: str) -> None:
    """pip download of the whole lock, wheels only, hash-checked; wheels already there are kept."""
    dest = wheels_dir(image)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / STAMP).unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--only-binary=:all:", *TARGET, "--require-hashes", "-r", str(lock_file(image)), "-d", str(dest)],
        check=True, timeout=1800,
    )
    (dest / STAMP).write_text(_lock_digest(image) + "\n")


def main() -> int:
    if not usable_here():
        print("kvshare: the image environment tests need CPython 3.11 on linux x86_64; not fetching their wheels",
              file=sys.stderr)
        return 0
    for image in IMAGES:
        if not wheels_ready(image):
            print(f"kvshare: fetching the wheels of requirements/{image}.txt for the image tests", file=sys.stderr)
            fetch_wheels(image)
        print(wheels_dir(image))
    return 0


if __name__ == "__main__":
    sys.exit(main())
