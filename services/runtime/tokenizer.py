"""The model's tokenizer (``tokenizer.json`` via the ``tokenizers`` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from services.errors import ModelLoadError


class TextTokenizer:
    """Encodes prompts and decodes generated ids; special tokens are dropped from decoded text."""

    def __init__(self, path: Path) -> None:
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for unreadable files
            raise ModelLoadError(f"{path}: cannot load tokenizer: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)
