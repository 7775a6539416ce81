"""Seeded-weight model folders built once and reused from the user's cache directory.

A folder is reused only when its build stamp names the same builder (the hash of the builder's
source and the preset) and its files still have the fingerprint recorded when it was built;
anything else (a partial build, an edited file, a newer builder) is built again, into a
temporary folder that replaces the old one only once complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from services.modelbuild.folder import write_decoder_folder
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec

STAMP = ".kvshare-build.json"
_BUILDER = Path(__file__).resolve().parents[1] / "modelbuild"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvshare/models``, else ``~/.cache/kvshare/models``: per user, never shared."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvshare" / "models"


def builder_identity(*parts: object) -> str:
    """A hash of the builder's source and ``parts`` (what is built: preset, layout, source file...)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode())
    for path in sorted(_BUILDER.glob("*.py")) + sorted(_BUILDER.glob("*.txt")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _fingerprint(folder: Path) -> str:
    """The model's own fingerprint (its graph) and a hash of the folder's other files (config,
    tokenizer, chat template), so that an edit to any of them is noticed."""
    digest = hashlib.sha256(load_model_spec(folder).fingerprint.encode())
    for name in ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "preprocessor_config.json"):
        path = folder / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b""))
    return digest.hexdigest()


def _reusable(folder: Path, identity: str) -> bool:
    try:
        stamp = json.loads((folder / STAMP).read_text())
        return stamp["builder"] == identity and _fingerprint(folder) == stamp["fingerprint"]
    except Exception:  # noqa: BLE001 - any unreadable stamp or folder means: build it again
        return False


def ensure_folder(folder: Path, identity: str, build: Callable[[Path], object], what: str) -> Path:
    """``folder`` as ``build(path)`` writes it, built (``what`` says into what) unless a verified
    build of the same ``identity`` is already there. Processes that ask for the same folder at once
    (parallel test workers, replicas started together) take turns on a lock file beside it: the first
    builds, the others then find its build; none ever removes a folder another is reading."""
    if _reusable(folder, identity):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _reusable(folder, identity):
            return folder
        print(f"building {what} into {folder} ...", file=sys.stderr, flush=True)
        partial = folder.with_name(f"{folder.name}.{os.getpid()}.part")
        shutil.rmtree(partial, ignore_errors=True)
        build(partial)
        stamp = {"builder": identity, "fingerprint": _fingerprint(partial)}
        (partial / STAMP).write_text(json.dumps(stamp))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    return folder


def ensure_model(folder: Path, preset: str = "small") -> Path:
    """The seeded decoder ``preset`` in ``folder``, built unless a verified build is already there."""
    return ensure_folder(folder, builder_identity(preset, KVLayout.SEPARATE.value, 0),
                         lambda path: write_decoder_folder(path, preset, KVLayout.SEPARATE),
                         f"the seeded-weight '{preset}' decoder")
