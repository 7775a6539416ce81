"""A model folder's generation defaults: the optional Hugging Face-style ``generation_config.json``
beside the ONNX files, of which kvshare reads the fields that a request may leave unset, and
(encoder-decoder models) the decoder's start sequence: ``decoder_start_token_id`` then
``forced_decoder_ids`` (Hugging Face's ``[[position, id], ...]``, positions 1, 2, ... in order)
and ``prev_sot_token_id``, the token before previous-text context (Whisper's ``<|startofprev|>``).

A folder without the file has no defaults. The file's other fields (sampling settings, lengths)
are not read: a request states those itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.errors import ModelLoadError

FILE_NAME = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Token id lists used where a request leaves the matching field unset; every id lies in
    ``[0, vocab_size)`` of the model they were loaded for."""

    suppress_tokens: tuple[int, ...] = ()
    """Ids masked at every generated token (the request's ``suppress_token_ids``)."""
    begin_suppress_tokens: tuple[int, ...] = ()
    """Ids masked at the first generated token (the request's ``begin_suppress_token_ids``)."""
    decoder_prompt: tuple[int, ...] = ()
    """The decoder's start sequence when the request gives no prompt ids (empty: the config's
    decoder start token alone)."""
    previous_text_token: int | None = None
    """Set for models whose text prompt is context before the start sequence (Whisper): the
    request's ``prompt`` text becomes ``[previous_text_token, *text ids, *decoder_prompt]``."""

    @classmethod
    def from_folder(cls, folder: Path, vocab_size: int) -> GenerationDefaults:
        """The defaults of ``folder/generation_config.json`` (none without that file); raises
        ModelLoadError naming the file and the field when it cannot be used."""
        path = folder / FILE_NAME
        if not path.exists():
            return cls()
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ModelLoadError(f"{path}: unreadable ({exc})") from exc
        if not isinstance(config, dict):
            raise ModelLoadError(f"{path}: must hold a JSON object, got {type(config).__name__}")
        lists = {name: _token_ids(path, config, name, vocab_size) for name in ("suppress_tokens", "begin_suppress_tokens")}
        start, previous = (_token_id(path, config, name, vocab_size) for name in ("decoder_start_token_id", "prev_sot_token_id"))
        forced = config.get("forced_decoder_ids") or []
        if not isinstance(forced, list) or any(not isinstance(f, list) or len(f) != 2 for f in forced):
            raise ModelLoadError(f"{path}: forced_decoder_ids must be a list of [position, token id] pairs")
        if [f[0] for f in forced] != list(range(1, len(forced) + 1)) or (forced and start is None):
            raise ModelLoadError(f"{path}: forced_decoder_ids must force positions 1, 2, ... in order after a "
                                 f"decoder_start_token_id, got {forced}")
        forced_ids = tuple(_checked_id(path, f"forced_decoder_ids[{i}][1]", f[1], vocab_size) for i, f in enumerate(forced))
        return cls(**lists, decoder_prompt=(start, *forced_ids) if forced_ids else (), previous_text_token=previous)


def _token_id(path: Path, config: dict, name: str, vocab_size: int) -> int | None:
    """``config[name]``: one id in the vocabulary, or None where absent or null."""
    value = config.get(name)
    return None if value is None else _checked_id(path, name, value, vocab_size)


def _checked_id(path: Path, label: str, value: object, vocab_size: int) -> int:
    """``value`` as a token id of the vocabulary; raises ModelLoadError naming ``label`` otherwise."""
    # bool is an int in Python, never a token id in JSON.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ModelLoadError(f"{path}: {label} = {value!r} is not a token id of the model's vocabulary [0, {vocab_size})")
    return value


def _token_ids(path: Path, config: dict, name: str, vocab_size: int) -> tuple[int, ...]:
    """``config[name]``: a list of ids in the vocabulary; absent or null is none (Hugging Face
    writes null for an unset list)."""
    value = config.get(name)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ModelLoadError(f"{path}: {name} must be a list of token ids, got {type(value).__name__}")
    return tuple(_checked_id(path, f"{name}[{i}]", t, vocab_size) for i, t in enumerate(value))
