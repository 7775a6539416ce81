"""The model's tokenizer (``tokenizer.json`` via the ``tokenizers`` library)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from services.errors import ModelLoadError
from services.runtime.memory import return_free_memory

TRIM_AFTER_CHARS = 1 << 20
"""Encoding this much text or more leaves hundreds of MB of freed buffers in the allocator's
arenas (the Rust side allocates several times the text's size); such encodes hand them back."""

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep the text unless their behavior is "Removed"


class TooManyTokens(Exception):
    """The text encodes to more tokens than the caller can use; ``count`` says how many."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} tokens")
        self.count = count


@dataclass(frozen=True, slots=True)
class TokenBytes:
    """How much text one token can stand for, from the vocabulary and the pipeline."""

    longest: int
    """Most bytes of input text one token can stand for: the longest vocabulary entry or added
    token (byte-level vocabularies: one byte per character; others: its UTF-8 length, an upper
    bound), and at least 4, one character that becomes an unknown token."""
    shrinker: str | None
    """The part of the pipeline that can drop or shorten text before tokens are made (a
    normalizer, a pre-tokenizer, a model that maps whole words to one unknown token), or None:
    then every byte of the text lies inside some token, so a text of B bytes is at least
    ⌈B / longest⌉ tokens."""


class TextTokenizer:
    """Encodes prompts and decodes generated ids; special tokens are dropped from decoded text."""

    def __init__(self, path: Path) -> None:
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for unreadable files
            raise ModelLoadError(f"{path}: cannot load tokenizer: {exc}") from exc

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """The ids of ``text``; raises TooManyTokens when there are more than ``max_tokens``.

        The Rust tokenizer runs with the GIL released (``encode_batch_fast``; ``Tokenizer.encode``
        holds it throughout: 3.5 s for 3.6 MB, stopping every Python thread, the scheduler's
        included). The ids become Python ints only when they are wanted, since that conversion
        holds the GIL (about 25 ns per id). Offsets, which the fast path skips, are not used.
        """
        encoding = self._tokenizer.encode_batch_fast([text])[0]
        count = len(encoding)
        ids = encoding.ids if max_tokens is None or count <= max_tokens else None
        del encoding
        if len(text) >= TRIM_AFTER_CHARS:
            return_free_memory()
        if ids is None:
            raise TooManyTokens(count)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def token_bytes(self) -> TokenBytes:
        """Reads the vocabulary and pipeline once (for the derived prompt size limit)."""
        config = json.loads(self._tokenizer.to_str())
        byte_level = any(p["type"] == "ByteLevel" for p in _parts(config.get("pre_tokenizer"), "pretokenizers"))
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=0)
        return TokenBytes(max(longest, 4), _shrinker(config))


def _parts(component: dict | None, key: str) -> list[dict]:
    """A normalizer or pre-tokenizer as the flat list of its steps (a Sequence is unpacked)."""
    if component is None:
        return []
    if component["type"] == "Sequence":
        return [p for c in component[key] for p in _parts(c, key)]
    return [component]


def _shrinker(config: dict) -> str | None:
    for step in _parts(config.get("normalizer"), "normalizers"):
        pattern = step.get("pattern", {}).get("String") if step["type"] == "Replace" else None
        if step["type"] == "Prepend" or (pattern is not None and len(step["content"].encode()) >= len(pattern.encode())):
            continue
        return f"normalizer {step['type']}"
    for step in _parts(config.get("pre_tokenizer"), "pretokenizers"):
        kind = step["type"]
        if kind in _KEEPING_PRE_TOKENIZERS or (kind in _SPLITTING_PRE_TOKENIZERS and step.get("behavior") != "Removed"):
            continue
        return f"pre-tokenizer {kind}"
    model = config["model"]
    fused_unknowns = model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback")
    if model["type"] != "BPE" or fused_unknowns:
        return f"model {model['type']}" + (" with fuse_unk" if fused_unknowns else "")
    return None
