"""Whisper's log-mel spectrogram, computed exactly as faster-whisper's ``FeatureExtractor`` does for
the first 30-s window that its ``transcribe()`` feeds the encoder.

For ``n`` samples at ``sampling_rate`` (at most ``n_samples``): ``hop_length`` zeros are appended;
a centred STFT (periodic Hann window of ``n_fft``, reflect-padded by ``n_fft // 2`` on each side,
hop ``hop_length``) gives ``n // hop + 2`` frames, of which the last is dropped; the power
spectrum goes through ``feature_size`` Slaney-style mel filters (librosa's ``htk=False``,
``norm="slaney"``), then ``log10(max(x, 1e-10))``, floored at its maximum minus 8, and mapped by
``(x + 4) / 4``. The first ``n // hop`` frames (transcribe's "content frames": the last computed one
is not) are the window's, followed by ``padding_value`` up to ``nb_max_frames``. The dtypes follow
faster-whisper's (float32 waveform, window and filters, complex64 spectrum), so with the same numpy
the features agree to float32 rounding.

The parameters come from the model folder's Hugging Face ``preprocessor_config.json``
(``WhisperFeatureExtractor``'s fields).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from services.errors import ModelLoadError

PREPROCESSOR_CONFIG = "preprocessor_config.json"


def mel_filters(sampling_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` triangular filters on the Slaney mel scale (linear below 1 kHz,
    logarithmic above), from 0 Hz to Nyquist, each scaled to unit area in Hz (float64)."""
    fft_hz = np.fft.rfftfreq(n=n_fft, d=1.0 / sampling_rate)
    linear_hz_per_mel = 200.0 / 3
    log_start_mel = 1000.0 / linear_hz_per_mel
    log_step = np.log(6.4) / 27.0
    top_mel = log_start_mel + np.log(sampling_rate / 2 / 1000.0) / log_step
    mels = np.linspace(0.0, top_mel, n_mels + 2)
    hz = linear_hz_per_mel * mels
    above = mels >= log_start_mel
    hz[above] = 1000.0 * np.exp(log_step * (mels[above] - log_start_mel))
    widths = np.diff(hz)
    ramps = hz[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    return triangles * (2.0 / (hz[2:] - hz[:-2]))[:, None]


def _number(config: dict, name: str, kind: str) -> int | float:
    """``config[name]`` as the field's type (``kind``: "int" or "float"); an integer field takes
    only integral values (30.0 is 30, 30.5 is refused)."""
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
            kind == "int" and value != int(value)):
        raise ValueError(f"{name} is {value!r}, not {'an integer' if kind == 'int' else 'a number'}")
    return int(value) if kind == "int" else float(value)


@dataclass(frozen=True, slots=True)
class AudioFeatures:
    """A model's audio front end: how many samples per second it hears and how they become the
    encoder's ``[1, feature_size, nb_max_frames]`` float32 input."""

    feature_size: int = 80
    """Mel bands."""
    sampling_rate: int = 16000
    """Hz."""
    hop_length: int = 160
    """Samples between frames."""
    n_fft: int = 400
    """Samples per frame (the window)."""
    chunk_length: int = 30
    """Seconds of one window."""
    n_samples: int = 480000
    """Samples of one window: ``chunk_length * sampling_rate``."""
    nb_max_frames: int = 3000
    """Frames of one window: ``n_samples // hop_length``."""
    padding_value: float = 0.0
    """The features' value past the end of the audio."""
    _filters: np.ndarray = field(init=False, repr=False, compare=False)
    _window: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_samples != self.chunk_length * self.sampling_rate or self.nb_max_frames != self.n_samples // self.hop_length:
            raise ValueError(f"n_samples {self.n_samples} and nb_max_frames {self.nb_max_frames} do not follow from "
                             f"chunk_length {self.chunk_length} s at {self.sampling_rate} Hz, hop {self.hop_length}")
        if min(self.feature_size, self.sampling_rate, self.hop_length, self.n_fft) <= 0:
            raise ValueError("feature_size, sampling_rate, hop_length and n_fft must be positive")
        filters = mel_filters(self.sampling_rate, self.n_fft, self.feature_size).astype(np.float32)
        object.__setattr__(self, "_filters", filters)
        object.__setattr__(self, "_window", np.hanning(self.n_fft + 1)[:-1].astype(np.float32))

    @property
    def max_seconds(self) -> float:
        """The longest audio one window holds."""
        return self.n_samples / self.sampling_rate

    @classmethod
    def from_folder(cls, folder: Path) -> AudioFeatures | None:
        """The front end ``folder/preprocessor_config.json`` describes, or None without that file;
        raises ModelLoadError when it is malformed."""
        path = folder / PREPROCESSOR_CONFIG
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: unreadable: {exc}") from exc
        if not isinstance(config, dict):
            raise ModelLoadError(f"{path}: must hold a JSON object, got {type(config).__name__}")
        try:
            values = {f.name: _number(config, f.name, f.type) for f in fields(cls) if f.init and f.name in config}
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc

    def log_mel(self, samples: np.ndarray) -> np.ndarray:
        """``[1, feature_size, nb_max_frames]`` float32 features of ``samples`` (mono, at
        ``sampling_rate``, at most ``n_samples``)."""
        if len(samples) > self.n_samples:
            raise ValueError(f"{len(samples)} samples; one window holds {self.n_samples}")
        hop, half = self.hop_length, self.n_fft // 2
        waveform = np.pad(samples.astype(np.float32, copy=False), (0, hop))
        padded = np.pad(waveform, half, mode="reflect")
        count = 1 + (len(padded) - self.n_fft) // hop
        frames = np.lib.stride_tricks.as_strided(padded, (count, self.n_fft), (hop * padded.strides[0], padded.strides[0]),
                                                 writeable=False)
        spectrum = np.fft.rfft(frames * self._window, n=self.n_fft, axis=-1).astype(np.complex64)
        power = np.abs(spectrum[:-1].T) ** 2
        log_spec = np.log10(np.clip(self._filters @ power, a_min=1e-10, a_max=None))
        log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
        log_spec = (log_spec + 4.0) / 4.0
        content = min(len(samples) // hop, self.nb_max_frames)
        out = np.full((1, self.feature_size, self.nb_max_frames), self.padding_value, dtype=np.float32)
        out[0, :, :content] = log_spec[:, :content]
        return out
