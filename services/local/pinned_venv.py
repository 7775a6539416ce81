"""Virtual environments of their own for tools whose pinned dependencies must stay out of the
project's environment (checkov for the scanner tests, faster-whisper as a benchmark peer).

A folder is ready once pip has installed exactly the pinned requirements into it: the stamp holding
them is written last, so a folder left by an interrupted install, or one made for other pins, is
recreated from scratch.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

STAMP = ".kvshare-ready"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_ready(venv: Path, requirements: Sequence[str]) -> bool:
    stamp = venv / STAMP
    return stamp.exists() and stamp.read_text() == _stamp_text(requirements) and venv_python(venv).exists()


def ensure_venv(venv: Path, requirements: Sequence[str], timeout_s: float = 1800) -> Path:
    """The python of ``venv`` with ``requirements`` (pip specifiers, pinned) installed, created unless
    a ready one is there already."""
    if venv_ready(venv, requirements):
        return venv_python(venv)
    # Without a pip of its own (seconds of copying): this pip installs into it.
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python(venv)), "install", "--quiet",
                    "--disable-pip-version-check", *requirements], check=True, timeout=timeout_s)
    (venv / STAMP).write_text(_stamp_text(requirements))
    return venv_python(venv)


def _stamp_text(requirements: Sequence[str]) -> str:
    return "".join(f"{r}\n" for r in requirements)
