"""WAV bytes to mono float32 samples at the rate a model takes.

Accepted: a RIFF/WAVE file whose ``fmt `` chunk is 16-bit PCM or 32-bit IEEE float, plain or as
WAVE_FORMAT_EXTENSIBLE with one of those subformats, mono or stereo, at 1 kHz to 192 kHz. Chunks
other than ``fmt `` and ``data`` (LIST, fact, bext, JUNK, ...) are skipped, odd-sized ones with
their pad byte; ``fmt `` must come before ``data``; nothing after ``data`` is read, and the RIFF
header's size is not either (streaming writers leave it unset).

A ``data`` chunk that declares more bytes than follow it (0xFFFFFFFF or a stale size from a writer
that streamed the file, or a file cut short) holds the bytes that are there, as FFmpeg reads it;
they must still be whole frames. A declared size of 0 means no samples (refused).

Stereo is downmixed by averaging the channels (what libswresample's stereo-to-mono matrix does for
faster-whisper), then resampled (``services.audio.resample``); the result is clipped to [-1, 1], as
faster-whisper's 16-bit decode clips louder float samples.

Every refusal is a ``WavError`` whose message names what was found and what would be accepted.
The duration is checked from the header, before any sample is converted. Memory: the samples
converted to float (twice the data's bytes for 16-bit PCM, once for float), then the resampler's
padded copy, output and blocks: a few times the bytes present, never sized by a header's claim.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from services.audio.resample import resample

MIN_RATE = 1_000
MAX_RATE = 192_000
MAX_CHANNELS = 2
MAX_CHUNKS = 64
"""Chunks before ``data``: real files have a handful; a file of millions of empty chunks would
otherwise cost a long walk before any refusal."""
OTHER_CHUNK_BYTES = 1 << 20
"""Bytes of chunks other than the samples that ``max_wav_bytes`` allows for (metadata, cover art)."""
ACCEPTED = "send 16-bit PCM or 32-bit float"
_EXTENSIBLE = 0xFFFE
_SUBFORMAT_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
"""Bytes 2..15 of a KSDATAFORMAT_SUBTYPE GUID; bytes 0..1 hold the format tag."""
_ENCODINGS = {(1, 16): "<i2", (3, 32): "<f4"}
_TAG_NAMES = {1: "PCM", 2: "Microsoft ADPCM", 3: "IEEE float", 6: "A-law", 7: "mu-law", 0x11: "IMA ADPCM",
              0x31: "GSM 6.10", 0x50: "MPEG", 0x55: "MPEG Layer 3"}


_OTHER_FORMATS = ((b"ID3", "MP3"), (b"\xff\xfb", "MP3"), (b"\xff\xf3", "MP3"), (b"\xff\xf2", "MP3"),
                  (b"fLaC", "FLAC"), (b"OggS", "Ogg"), (b"FORM", "AIFF"), (b"\x1aE\xdf\xa3", "WebM/Matroska"))
"""Leading bytes of audio files people send instead of WAV, named in the refusal."""


class WavError(ValueError):
    """The bytes are not audio kvshare can read; the message says what was found and what to send."""


@dataclass(frozen=True, slots=True)
class WavLayout:
    """Where a file's samples are and how they are stored (from the header alone)."""

    sample_rate: int
    """Frames per second, Hz."""
    channels: int
    dtype: str
    """numpy dtype of one sample: ``<i2`` or ``<f4``."""
    data_offset: int
    """Byte offset of the first sample."""
    frames: int
    """Whole frames in the data chunk's bytes that are present."""

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


def max_wav_bytes(seconds: float) -> int:
    """The most bytes an acceptable WAV file of at most ``seconds`` can have: the densest
    accepted samples (stereo 32-bit float at the highest rate) plus ``OTHER_CHUNK_BYTES``. A
    longer input is refused unread."""
    return int(seconds * MAX_RATE) * MAX_CHANNELS * 4 + OTHER_CHUNK_BYTES


def _format_name(tag: int, bits: int) -> str:
    if tag == 1:
        return f"{bits}-bit PCM"
    if tag == 3:
        return f"{bits}-bit float"
    return f"format tag 0x{tag:04x} ({_TAG_NAMES.get(tag, 'unknown')})"


def _read_fmt(body: bytes) -> tuple[int, int, str]:
    """(sample rate, channels, numpy dtype) of a ``fmt `` chunk's body."""
    if len(body) < 16:
        raise WavError(f"truncated fmt chunk: {len(body)} bytes, a WAV fmt chunk has at least 16")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", body)
    if tag == _EXTENSIBLE:
        if len(body) < 40:
            raise WavError(f"truncated WAVE_FORMAT_EXTENSIBLE fmt chunk: {len(body)} bytes, it has 40")
        subformat = body[24:40]
        if subformat[2:] != _SUBFORMAT_TAIL:
            raise WavError(f"WAVE_FORMAT_EXTENSIBLE subformat {subformat.hex()} not supported; {ACCEPTED}")
        tag = int.from_bytes(subformat[:2], "little")
    dtype = _ENCODINGS.get((tag, bits))
    if dtype is None:
        raise WavError(f"{_format_name(tag, bits)} not supported; {ACCEPTED}")
    if channels == 0 or channels > MAX_CHANNELS:
        raise WavError(f"{channels} channels not supported; send mono or stereo")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise WavError(f"sample rate {rate} Hz not supported; send {MIN_RATE} to {MAX_RATE} Hz (16000 needs no resampling)")
    if block_align != channels * bits // 8:
        raise WavError(f"malformed fmt chunk: block align {block_align} bytes for {channels} channel(s) of {bits} bits")
    return rate, channels, dtype


def read_layout(data: bytes) -> WavLayout:
    """The layout of WAV file ``data``, read from its header and chunk sizes; raises WavError."""
    if not data:
        raise WavError("empty: no bytes; send a WAV file")
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        kind = next((f" (it looks like {name})" for magic, name in _OTHER_FORMATS if data.startswith(magic)), "")
        raise WavError(f"not a WAV file: starts with {data[:12]!r}{kind}; send RIFF/WAVE bytes "
                       "(e.g. `ffmpeg -i FILE -ac 1 -ar 16000 out.wav`)")
    fmt = None
    offset = 12
    for _ in range(MAX_CHUNKS):
        if offset + 8 > len(data):
            what = "no data chunk" if offset >= len(data) else f"truncated chunk header at byte {offset}"
            raise WavError(f"{what} after {len(data)} bytes; the file is cut short or has no samples")
        chunk_id, size = data[offset:offset + 4], int.from_bytes(data[offset + 4:offset + 8], "little")
        body = offset + 8
        if chunk_id == b"data":
            if fmt is None:
                raise WavError("data chunk before any fmt chunk; the fmt chunk must come first")
            rate, channels, dtype = fmt
            present = min(size, len(data) - body)
            frame = channels * np.dtype(dtype).itemsize
            if present == 0:
                raise WavError("the data chunk holds no samples")
            if present % frame:
                raise WavError(f"the data chunk holds {present} bytes: not whole frames of {frame} bytes "
                               f"({channels} channel(s) x {frame // channels})")
            return WavLayout(rate, channels, dtype, body, present // frame)
        if chunk_id == b"fmt ":
            if body + size > len(data):
                raise WavError(f"truncated fmt chunk: declares {size} bytes, {len(data) - body} follow")
            fmt = _read_fmt(data[body:body + size])
        offset = body + size + (size & 1)
    raise WavError(f"no data chunk among the first {MAX_CHUNKS} chunks")


def decode_wav(data: bytes, rate: int, max_seconds: float) -> np.ndarray:
    """WAV file ``data`` as mono float32 samples in [-1, 1] at ``rate`` Hz; raises WavError,
    among others when it is longer than ``max_seconds`` (checked before decoding)."""
    layout = read_layout(data)
    if layout.seconds > max_seconds:
        raise WavError(f"{layout.seconds:.1f} s of audio; at most {max_seconds:g} s per request")
    raw = np.frombuffer(data, dtype=layout.dtype, count=layout.frames * layout.channels, offset=layout.data_offset)
    if raw.dtype.kind == "f":
        if not np.isfinite(raw).all():
            raise WavError("the float samples hold NaN or infinity")
        samples = raw.astype(np.float32)
    else:
        samples = raw.astype(np.float32) * np.float32(1 / 32768)
    if layout.channels == 2:  # halves first: the sum of two loud float samples would overflow to infinity
        samples = samples[0::2] * np.float32(0.5) + samples[1::2] * np.float32(0.5)
    samples = resample(samples, layout.sample_rate, rate)
    return np.clip(samples, -1.0, 1.0, out=samples)
