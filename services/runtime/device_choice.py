"""``--device``: which device a worker runs on, as the user writes it (no imports of ONNX Runtime
or CuPy here: the configuration checks it before anything loads)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_FORM = re.compile(r"(?P<kind>auto|cpu)|(?P<cuda>cuda)(?::(?P<index>[0-9]{1,3}))?")
"""ASCII digits only: ``str.isdigit`` also takes superscripts and other scripts' digits."""


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``, or ``auto`` (CUDA when it can be used, else CPU)."""

    kind: str
    index: int = 0

    @classmethod
    def parse(cls, text: str) -> DeviceChoice:
        found = _FORM.fullmatch(text.strip().lower())
        if found is None:
            raise ValueError(f"--device {text!r}: expected auto, cpu, cuda or cuda:N (N a device number: 0, 1, ...)")
        if found["kind"]:
            return cls(found["kind"])
        return cls("cuda", int(found["index"] or 0))

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else self.kind
