"""The encoder input of an encoder-decoder request: validated and turned into the array the
encoder takes (token ids ``[1, tokens]``, or float features of the model's shape, given as such or
computed from WAV audio by the model's ``AudioFeatures``). Runs on a tokenizer thread, or for a
request with audio on an audio thread: decoding and resampling never hold the event loop."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.audio.wav import WavError, decode_wav
from services.errors import InvalidRequest, RequestOutOfRange
from services.runtime.memory import return_free_memory
from services.runtime.model_spec import ModelSpec
from services.runtime.onnx_encoder import EncoderSession
from services.runtime.tokenizer import TextTokenizer, TooManyTokens

TRIM_AFTER_AUDIO_BYTES = 1 << 20
"""Decoding this much audio or more leaves its resampling buffers (~5x the file) in glibc's arenas,
which a flood of such files grows for good (3.2 GB after 32 at 192 kHz); such decodes hand them back."""
_FEATURE_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


@dataclass(frozen=True, slots=True)
class EncoderFeatures:
    """A dense tensor from the request: ``data`` is little-endian, C order."""

    shape: Sequence[int]
    dtype: str
    data: bytes


@dataclass(slots=True)
class EncoderRequest:
    """At most one of the four is set by a client; validation enforces exactly one."""

    prompt: str | None = None
    token_ids: Sequence[int] | None = None
    features: EncoderFeatures | None = None
    audio: bytes | None = None
    """A WAV file (``services.audio.wav`` says which), for a model with ``ModelSpec.audio``."""

    @property
    def given(self) -> list[str]:
        names = {"encoder_prompt": self.prompt, "encoder_prompt_token_ids": self.token_ids,
                 "encoder_features": self.features, "encoder_audio": self.audio}
        return [name for name, value in names.items() if value]


def _beyond_context(field: str, tokens: int, limit: int) -> RequestOutOfRange:
    return RequestOutOfRange(field, f"{tokens} tokens exceed the encoder's context length of {limit}")


def encoder_array(request: EncoderRequest, spec: ModelSpec, tokenizer: TextTokenizer,
                  encoder: EncoderSession | None) -> np.ndarray | None:
    """The encoder's input for ``request``, or None for a decoder-only model; raises InvalidRequest."""
    given = request.given
    if encoder is None:
        if given:
            raise InvalidRequest(given[0], f"model {spec.name} is decoder-only and takes no encoder input")
        return None
    if not given and spec.audio is not None and not encoder.takes_token_ids:
        raise InvalidRequest("encoder_audio", f"model {spec.name} is a speech model: send the audio as encoder_audio "
                             "(a WAV file; from a shell, `kvshare transcribe FILE.wav`)")
    if len(given) != 1:
        detail = "is required" if not given else f"got {', '.join(given)}"
        raise InvalidRequest("encoder_prompt", f"model {spec.name} is encoder-decoder: exactly one of "
                             f"encoder_prompt, encoder_prompt_token_ids, encoder_features, encoder_audio {detail}")
    field = given[0]
    if request.audio:
        if spec.audio is None or encoder.takes_token_ids:
            takes = "encoder_prompt or encoder_prompt_token_ids" if encoder.takes_token_ids else "encoder_features"
            raise InvalidRequest(field, f"model {spec.name} takes no audio (its folder has no preprocessor_config.json "
                                 f"for a float-input encoder): send {takes}")
        try:
            samples = decode_wav(request.audio, spec.audio.sampling_rate, spec.audio.max_seconds)
        except WavError as exc:
            raise InvalidRequest(field, str(exc)) from None
        # The server makes these features, so they take the encoder's float type (a float16 export).
        array = spec.audio.log_mel(samples).astype(encoder.input_dtype, copy=False)
        del samples
        if len(request.audio) >= TRIM_AFTER_AUDIO_BYTES:
            return_free_memory()
    elif request.features is not None:
        if encoder.takes_token_ids:
            raise InvalidRequest(field, "this encoder takes token ids: use encoder_prompt or encoder_prompt_token_ids")
        f = request.features
        dtype = _FEATURE_DTYPES.get(f.dtype)
        if dtype is None:
            raise InvalidRequest(f"{field}.dtype", f"{f.dtype!r} is not one of {sorted(_FEATURE_DTYPES)}")
        shape = tuple(f.shape)
        # math.prod on Python ints: a huge shape cannot wrap around and pass the size check.
        if any(d <= 0 for d in shape) or len(f.data) != math.prod(shape) * dtype.itemsize:
            raise InvalidRequest(f"{field}.data", f"{len(f.data)} bytes do not hold a {f.dtype} tensor of shape {list(shape)}")
        array = np.frombuffer(f.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
        if not np.isfinite(array).all():
            raise InvalidRequest(f"{field}.data", "the features hold NaN or infinity")
    else:
        if not encoder.takes_token_ids:
            audio = " or encoder_audio (a WAV file: `kvshare transcribe FILE.wav`)" if spec.audio is not None else ""
            raise InvalidRequest(field, f"this encoder takes float features: use encoder_features{audio}")
        limit = spec.encoder.context_length
        try:
            ids = list(request.token_ids) if request.token_ids else tokenizer.encode(request.prompt or "", limit)
        except TooManyTokens as exc:
            raise _beyond_context(field, exc.count, limit) from None
        for i, t in enumerate(ids):
            if not 0 <= t < spec.vocab_size:
                raise InvalidRequest(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {spec.vocab_size})")
        if not ids:
            raise InvalidRequest(field, "the encoder prompt encodes to no tokens")
        if limit is not None and len(ids) > limit:
            raise _beyond_context(field, len(ids), limit)
        array = np.asarray([ids], dtype=encoder.input_dtype)
    encoder.check_input(array, field)
    return array
