"""Reads a CTranslate2 ``model.bin`` (binary format version 6) into numpy arrays.

The layout, as CTranslate2's ``ModelSpec._serialize`` writes it (all integers little-endian):
u32 format version, string spec name, u32 spec revision, u32 variable count; per variable a string
name, u8 rank, u32 per dimension, u8 dtype id, u32 byte count and the raw bytes; then u32 alias
count and per alias two strings (alias, target). A string is a u16 length counting a trailing NUL,
then that many bytes. Every read is bounds-checked: a truncated or forged file raises
``CTranslate2FormatError``, never an IndexError or a huge allocation.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUPPORTED_VERSION = 6
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
"""CTranslate2's type ids; 5 (bfloat16) has no numpy type and is refused."""


class CTranslate2FormatError(ValueError):
    """The file is not a CTranslate2 model this reader understands; the message says why."""


@dataclass(frozen=True, slots=True)
class CTranslate2Model:
    spec: str
    """The spec's class name, e.g. ``WhisperSpec``."""
    revision: int
    variables: dict[str, np.ndarray]
    """Every variable by name, aliases resolved (an alias maps to the same array)."""

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.variables[name]
        except KeyError:
            raise CTranslate2FormatError(f"{self.spec} model has no variable {name!r}") from None


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._at = 0

    def take(self, count: int) -> memoryview:
        if count < 0 or self._at + count > len(self._data):
            raise CTranslate2FormatError(f"truncated at byte {self._at}: {count} more bytes expected")
        chunk = self._data[self._at:self._at + count]
        self._at += count
        return chunk

    def unpack(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.unpack("H")
        raw = bytes(self.take(size))
        if not raw or raw[-1] != 0:
            raise CTranslate2FormatError(f"string before byte {self._at} is not NUL-terminated")
        return raw[:-1].decode("utf-8")


def read_ctranslate2_model(path: Path) -> CTranslate2Model:
    """The variables of ``path`` (copied out of the file: the arrays are writable and own their memory)."""
    reader = _Reader(path.read_bytes())
    version = reader.unpack("I")
    if version != SUPPORTED_VERSION:
        raise CTranslate2FormatError(f"{path}: binary format version {version}; this reader knows {SUPPORTED_VERSION}")
    spec, revision = reader.string(), reader.unpack("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        shape = tuple(reader.unpack("I") for _ in range(reader.unpack("B")))
        type_id, size = reader.unpack("B"), reader.unpack("I")
        dtype = _DTYPES.get(type_id)
        if dtype is None:
            raise CTranslate2FormatError(f"{path}: variable {name!r} has type id {type_id}, which this reader does not read")
        if size != math.prod(shape) * np.dtype(dtype).itemsize:
            raise CTranslate2FormatError(f"{path}: variable {name!r} holds {size} bytes, not a {np.dtype(dtype)} {list(shape)}")
        variables[name] = np.frombuffer(reader.take(size), dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape).copy()
    for _ in range(reader.unpack("I")):
        alias, target = reader.string(), reader.string()
        if target not in variables:
            raise CTranslate2FormatError(f"{path}: alias {alias!r} names a missing variable {target!r}")
        variables[alias] = variables[target]
    return CTranslate2Model(spec, revision, variables)
