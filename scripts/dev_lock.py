"""Reads the project's pip locks (requirements/*.txt, written by scripts/lock.sh) and keeps the development
virtualenv equal to requirements/dev.txt.

    .venv/bin/python scripts/dev_lock.py prune    # uninstall what the lock does not hold (scripts/venv.sh)

A lock line is ``name==version [; marker] \\`` followed by its ``--hash`` lines; a name may appear once
per marker (a pin that differs between Python versions). ``pinned`` evaluates the markers for this
interpreter.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DEV_LOCK = ROOT / "requirements" / "dev.txt"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")


@dataclass(frozen=True)
class Pin:
    name: str
    """Canonical (PEP 503) name."""
    version: str
    marker: Marker | None
    """Where the pin applies (None: everywhere)."""

    def applies(self, environment: dict[str, str] | None = None) -> bool:
        return self.marker is None or self.marker.evaluate(environment)


def read_lock(path: Path) -> list[Pin]:
    """Every pin of a lock, in file order; hash and comment lines are skipped."""
    pins = []
    for line in path.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            name, version, marker = match.groups()
            pins.append(Pin(canonicalize_name(name), version, Marker(marker) if marker else None))
    return pins


def pinned(path: Path, environment: dict[str, str] | None = None) -> dict[str, str]:
    """Name -> version of the pins that apply to ``environment`` (default: this interpreter)."""
    return {pin.name: pin.version for pin in read_lock(path) if pin.applies(environment)}


def prune(lock: Path = DEV_LOCK) -> list[str]:
    """Uninstalls the distributions of this environment that ``lock`` does not hold (pip and kvshare
    itself are kept) and returns their names: an environment updated across lock changes then holds
    what a fresh one would."""
    keep = set(pinned(lock)) | {"pip", "kvshare"}
    extra = sorted({canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()} - keep)
    if extra:
        print(f"kvshare: removing what {lock.name} no longer holds: {' '.join(extra)}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes", *extra], check=True)
    return extra


if __name__ == "__main__":
    if sys.argv[1:] != ["prune"]:
        sys.exit(__doc__)
    prune()
