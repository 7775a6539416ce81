"""A GGUF's key-value fields as the converter reads them, and the one error it raises: shared by the
reader (services/modelbuild/gguf_model.py) and each architecture's mapping
(services/modelbuild/gguf_architectures.py), which reads its shape from its own keys."""

from __future__ import annotations


class GGUFError(ValueError):
    """The file is not a model the converter can represent; the message names what."""


class Fields:
    """The file's key-value fields, read with an architecture's prefix or whole."""

    def __init__(self, reader, arch: str) -> None:
        self._fields, self.arch = reader.fields, arch

    def get(self, key: str, default: object = None) -> object:
        f = self._fields.get(key)
        return default if f is None else f.contents()

    def arch_get(self, key: str, default: object = None) -> object:
        """``{arch}.{key}``."""
        return self.get(f"{self.arch}.{key}", default)

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self._fields

    def required(self, key: str) -> object:
        value = self.arch_get(key)
        if value is None:
            raise GGUFError(f"{self.arch}.{key} is missing")
        return value
