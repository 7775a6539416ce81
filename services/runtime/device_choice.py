"""``--device``: which device a worker runs on, as the user writes it (no imports of ONNX Runtime
or CuPy here: the configuration checks it before anything loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``, or ``auto`` (CUDA when it can be used, else CPU)."""

    kind: str
    index: int = 0

    @classmethod
    def parse(cls, text: str) -> DeviceChoice:
        kind, _, index = text.strip().lower().partition(":")
        if kind in ("auto", "cpu") and not index:
            return cls(kind)
        if kind == "cuda" and (not index or index.isdigit()):
            return cls(kind, int(index or 0))
        raise ValueError(f"--device {text!r}: expected auto, cpu, cuda or cuda:N")

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else self.kind
