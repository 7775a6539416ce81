"""Peer programs' own virtual environments, for benchmarks that compare kvshare with another
runtime whose pinned packages must never enter the project's ``.venv``.

Each peer gets ``.bench-env/<name>/`` in the repository root (ignored by git), created on first use
and reused while its pins are unchanged (``services.local.pinned_venv``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.local.pinned_venv import ensure_venv, venv_ready

ROOT = Path(__file__).resolve().parent.parent

WHISPER_PEER = ("faster-whisper==1.2.1", "ctranslate2==4.8.5")
"""faster-whisper on CTranslate2 (with av, tokenizers, onnxruntime, huggingface_hub: ~470 MB)."""


def peer_python(name: str, requirements: Sequence[str]) -> Path:
    """The python of peer ``name``'s environment with ``requirements`` installed (minutes the first
    time: pip downloads them)."""
    venv = ROOT / ".bench-env" / name
    if not venv_ready(venv, requirements):
        print(f"installing {' '.join(requirements)} into {venv} (once) ...", flush=True)
    return ensure_venv(venv, requirements)
