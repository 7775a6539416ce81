"""WAV decoding (services/audio/wav.py) and resampling (services/audio/resample.py) on files built
here byte by byte: the accepted encodings give the samples back, stereo is averaged, a resampled
sine keeps its frequency and amplitude, odd and unknown chunks are walked over, and every refusal
says what it found. Against faster-whisper's own decode: tests/test_log_mel.py."""

import io
import math
import struct
import tracemalloc
import wave

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.audio.resample import resample
from services.audio.wav import (
    MAX_CHUNKS,
    OTHER_CHUNK_BYTES,
    WavError,
    decode_wav,
    max_wav_bytes,
    read_layout,
)

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"


def chunk(name: bytes, body: bytes, size: int | None = None) -> bytes:
    """A RIFF chunk; an odd-sized body gets its pad byte. ``size`` overrides the declared size."""
    return name + struct.pack("<I", len(body) if size is None else size) + body + b"\0" * (len(body) & 1)


def fmt_body(tag: int, channels: int, rate: int, bits: int, extensible: bool = False, block: int | None = None) -> bytes:
    block = channels * bits // 8 if block is None else block
    head = struct.pack("<HHIIHH", EXTENSIBLE if extensible else tag, channels, rate, (rate * block) % 2**32, block, bits)
    if not extensible:
        return head
    return head + struct.pack("<HHI", 22, bits, 0x3 if channels == 2 else 0x4) + struct.pack("<H", tag) + GUID_TAIL


def wav(samples: np.ndarray, rate: int = 16000, *, tag: int = PCM, bits: int = 16, extensible: bool = False,
        before: bytes = b"", after: bytes = b"", data_size: int | None = None) -> bytes:
    """A WAV file of ``samples`` (``[frames]`` or ``[frames, channels]``, already in the file's
    dtype), with ``before`` chunks between fmt and data and ``after`` chunks after it."""
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    body = chunk(b"fmt ", fmt_body(tag, channels, rate, bits, extensible)) + before
    body += chunk(b"data", samples.tobytes(), data_size) + after
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WAVE" + body


def pcm16(x: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(x) * 32767).astype("<i2")


def sine(rate: int, hz: float, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * hz * np.arange(round(rate * seconds)) / rate)


def tone(x: np.ndarray, rate: int, hz: float) -> tuple[float, float]:
    """(amplitude of ``hz`` in ``x``, RMS of what is left), fitted by least squares."""
    t = np.arange(len(x)) / rate
    basis = np.stack([np.sin(2 * np.pi * hz * t), np.cos(2 * np.pi * hz * t)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, x, rcond=None)
    return float(np.hypot(*coef)), float(np.sqrt(np.mean((x - basis @ coef) ** 2)))


def decode(data: bytes, rate: int = 16000, max_seconds: float = 30.0) -> np.ndarray:
    return decode_wav(data, rate, max_seconds)


# --- accepted encodings ------------------------------------------------------------------------


@pytest.mark.parametrize("extensible", [False, True])
def test_16_bit_pcm_gives_its_samples_over_32768(extensible):
    samples = np.array([0, 1, -1, 32767, -32768, 12345, -2], dtype="<i2")
    out = decode(wav(samples, extensible=extensible))
    assert out.dtype == np.float32 and out.shape == (7,)
    assert np.array_equal(out, samples.astype(np.float32) / 32768)


@pytest.mark.parametrize("extensible", [False, True])
def test_32_bit_float_gives_its_samples(extensible):
    samples = np.array([0.0, 0.25, -0.5, 1.0, -1.0, 1e-7], dtype="<f4")
    assert np.array_equal(decode(wav(samples, tag=FLOAT, bits=32, extensible=extensible)), samples)


def test_float_samples_beyond_full_scale_are_clipped_as_a_16_bit_decode_would():
    samples = np.array([1.5, -3.0, 0.5], dtype="<f4")
    assert decode(wav(samples, tag=FLOAT, bits=32)).tolist() == [1.0, -1.0, 0.5]


@pytest.mark.parametrize("rate", [16000, 44100])
def test_the_loudest_finite_stereo_floats_clip_to_full_scale_and_never_overflow(rate):
    loud = np.full((rate // 10, 2), 3e38, dtype="<f4")
    loud[1::2] *= -1
    out = decode(wav(loud, rate, tag=FLOAT, bits=32))
    assert np.isfinite(out).all() and np.abs(out).max() == 1.0


def test_what_pythons_wave_module_writes_is_read():
    samples = pcm16(sine(16000, 440, 0.1))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(samples.tobytes())
    assert np.array_equal(decode(buffer.getvalue()), samples / np.float32(32768))


@pytest.mark.parametrize("encoding", ["pcm16", "float32"])
def test_stereo_is_averaged_to_mono(encoding):
    left, right = sine(16000, 300, 0.05), sine(16000, 700, 0.05, 0.25)
    if encoding == "pcm16":
        frames = np.stack([pcm16(left), pcm16(right)], axis=1)
        data, scale = wav(frames), 1 / 32768
    else:
        frames = np.stack([left, right], axis=1).astype("<f4")
        data, scale = wav(frames, tag=FLOAT, bits=32), 1.0
    out = decode(data)
    expected = (frames[:, 0].astype(np.float64) + frames[:, 1]) * scale / 2
    assert np.abs(out - expected).max() < 1e-7


# --- resampling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8000, 11025, 22050, 44100, 48000, 96000, 44101, 192000])
def test_a_resampled_sine_keeps_its_frequency_and_amplitude(rate):
    """44101 Hz reduces to no small fraction of 16 kHz: its filter phases are interpolated."""
    x = sine(rate, 1000.0, 0.5, amplitude=0.5)
    out = decode(wav(x.astype("<f4"), rate, tag=FLOAT, bits=32))
    assert len(out) == math.ceil(len(x) * 16000 / rate)
    amplitude, residual = tone(out[200:-200].astype(np.float64), 16000, 1000.0)
    assert abs(amplitude - 0.5) < 5e-4 and residual < 5e-4, (amplitude, residual)
    # Sample k is the input at time k / 16000: the phase is kept, not only the frequency.
    t = np.arange(len(out)) / 16000
    assert np.abs(out[200:-200] - 0.5 * np.sin(2 * np.pi * 1000 * t[200:-200])).max() < 2e-3


@pytest.mark.parametrize("rate", [44100, 48000, 44101])
def test_resampling_removes_what_16_khz_cannot_hold_and_keeps_a_constant(rate):
    above = decode(wav(sine(rate, 11000.0, 0.3).astype("<f4"), rate, tag=FLOAT, bits=32))
    assert np.sqrt(np.mean(above[100:-100] ** 2)) < 1e-3
    constant = resample(np.full(rate // 10, 0.25), rate, 16000)
    assert np.abs(constant - 0.25).max() < 1e-6, "reflected ends and unit-gain phases keep a constant whole"


def test_resampling_is_deterministic_and_16_khz_passes_through():
    x = np.random.default_rng(3).standard_normal(44100).astype(np.float32) * 0.1
    assert np.array_equal(resample(x, 44100, 16000), resample(x, 44100, 16000))
    assert np.array_equal(resample(x, 16000, 16000), x)


# --- chunks ---------------------------------------------------------------------------------------


def test_unknown_and_odd_sized_chunks_are_skipped_and_what_follows_data_is_not_read():
    samples = pcm16(sine(16000, 440, 0.01))
    plain = decode(wav(samples))
    info = chunk(b"LIST", b"INFOISFT" + struct.pack("<I", 5) + b"kvs\0\0")
    odd = chunk(b"junk", b"abc")  # 3 bytes and a pad byte
    fact = chunk(b"fact", struct.pack("<I", len(samples)))
    garbage_after = chunk(b"LIST", b"\xff" * 7) + b"RIFF nonsense"
    assert np.array_equal(decode(wav(samples, before=info + odd + fact, after=garbage_after)), plain)
    # A LIST chunk before fmt too (some writers put metadata first).
    data = wav(samples)
    moved = data[:12] + info + data[12:]
    assert np.array_equal(decode(moved), plain)


def test_a_fmt_chunk_with_extra_bytes_is_read():
    samples = pcm16(sine(16000, 440, 0.01))
    body = chunk(b"fmt ", fmt_body(PCM, 1, 16000, 16) + struct.pack("<H", 0)) + chunk(b"data", samples.tobytes())
    assert np.array_equal(decode(b"RIFF\0\0\0\0WAVE" + body), samples / np.float32(32768))


@pytest.mark.parametrize("declared", [0xFFFFFFFF, 10**6])
def test_a_data_size_past_the_end_takes_the_whole_frames_there(declared):
    """Streaming writers leave 0xFFFFFFFF (or a stale size) in the data chunk: the bytes present are the data."""
    samples = pcm16(sine(16000, 440, 0.01))
    assert np.array_equal(decode(wav(samples, data_size=declared)), samples / np.float32(32768))
    cut = wav(samples, data_size=declared)[:-1]
    with pytest.raises(WavError, match=r"the data chunk holds 319 bytes: not whole frames of 2 bytes"):
        decode(cut)


def test_the_layout_is_read_from_the_header():
    layout = read_layout(wav(np.zeros((480, 2), "<f4"), 48000, tag=FLOAT, bits=32, before=chunk(b"LIST", b"x" * 9)))
    assert (layout.sample_rate, layout.channels, layout.dtype, layout.frames) == (48000, 2, "<f4", 480)
    assert layout.data_offset == 12 + 8 + 16 + 8 + 10 + 8 and layout.seconds == 0.01


# --- refusals -------------------------------------------------------------------------------------

SHORT = pcm16(np.zeros(16))
REFUSALS = {
    "empty": (b"", "empty: no bytes; send a WAV file"),
    "mp3": (b"ID3\x04\0\0\0\0\0\x21TIT2" + b"\0" * 40, r"not a WAV file: starts with b'ID3\\x04\\x00"),
    "avi": (b"RIFF\0\0\0\0AVI LIST", "not a WAV file: starts with b'RIFF\\\\x00\\\\x00\\\\x00\\\\x00AVI '"),
    "header only": (b"RIFF\0\0\0\0WAVE", "no data chunk after 12 bytes"),
    "cut in a chunk header": (b"RIFF\0\0\0\0WAVEfmt \x10", "truncated chunk header at byte 12"),
    "cut in fmt": (wav(SHORT)[:30], "truncated fmt chunk: declares 16 bytes, 10 follow"),
    "short fmt": (b"RIFF\0\0\0\0WAVE" + chunk(b"fmt ", b"\1\0\1\0") + chunk(b"data", b"\0\0"),
                  "truncated fmt chunk: 4 bytes, a WAV fmt chunk has at least 16"),
    "short extensible fmt": (b"RIFF\0\0\0\0WAVE" + chunk(b"fmt ", fmt_body(PCM, 1, 16000, 16, True)[:30]),
                             "truncated WAVE_FORMAT_EXTENSIBLE fmt chunk: 30 bytes"),
    "8-bit": (wav(np.zeros(8, "u1"), bits=8), r"^8-bit PCM not supported; send 16-bit PCM or 32-bit float$"),
    "24-bit": (wav(np.zeros(24, "u1"), bits=24), r"^24-bit PCM not supported; send 16-bit PCM or 32-bit float$"),
    "32-bit int": (wav(np.zeros(4, "<i4"), bits=32), "32-bit PCM not supported"),
    "64-bit float": (wav(np.zeros(4, "<f8"), tag=FLOAT, bits=64), "64-bit float not supported"),
    "24-bit extensible": (wav(np.zeros(24, "u1"), bits=24, extensible=True), "24-bit PCM not supported"),
    "a-law": (wav(np.zeros(8, "u1"), tag=6, bits=8), r"format tag 0x0006 \(A-law\) not supported; send 16-bit PCM"),
    "mp3 in wav": (wav(np.zeros(8, "u1"), tag=0x55, bits=0), r"format tag 0x0055 \(MPEG Layer 3\) not supported"),
    "unknown subformat": (wav(SHORT, extensible=True).replace(GUID_TAIL, b"\x01" * 14),
                          "WAVE_FORMAT_EXTENSIBLE subformat 01000101010101010101010101010101 not supported"),
    "three channels": (wav(np.zeros((4, 3), "<i2")), r"^3 channels not supported; send mono or stereo$"),
    "six channels": (wav(np.zeros((4, 6), "<f4"), tag=FLOAT, bits=32), "6 channels not supported"),
    "no channels": (b"RIFF\0\0\0\0WAVE" + chunk(b"fmt ", fmt_body(PCM, 0, 16000, 16, block=0)) + chunk(b"data", b"\0\0"),
                    "0 channels not supported"),
    "rate 0": (wav(SHORT, rate=0), r"sample rate 0 Hz not supported; send 1000 to 192000 Hz"),
    "rate absurd": (wav(SHORT, rate=4_000_000_000), "sample rate 4000000000 Hz not supported"),
    "rate too low": (wav(SHORT, rate=999), "sample rate 999 Hz not supported"),
    "block align": (b"RIFF\0\0\0\0WAVE" + chunk(b"fmt ", fmt_body(PCM, 2, 16000, 16, block=2)) + chunk(b"data", b"\0" * 8),
                    "malformed fmt chunk: block align 2 bytes for 2 channel"),
    "half a frame": (wav(np.zeros((3, 2), "<i2"))[:-2], r"holds 10 bytes: not whole frames of 4 bytes \(2 channel\(s\) x 2\)"),
    "odd bytes": (b"RIFF\0\0\0\0WAVE" + chunk(b"fmt ", fmt_body(PCM, 1, 16000, 16)) + chunk(b"data", b"\0\0\0"),
                  "holds 3 bytes: not whole frames of 2 bytes"),
    "no samples": (wav(np.zeros(0, "<i2")), "the data chunk holds no samples"),
    "data before fmt": (b"RIFF\0\0\0\0WAVE" + chunk(b"data", b"\0\0") + chunk(b"fmt ", fmt_body(PCM, 1, 16000, 16)),
                        "data chunk before any fmt chunk"),
    "no data": (b"RIFF\0\0\0\0WAVE" + chunk(b"fmt ", fmt_body(PCM, 1, 16000, 16)) + chunk(b"LIST", b"x" * 4),
                "no data chunk after 48 bytes"),
    "chunk size past the end": (b"RIFF\0\0\0\0WAVE" + chunk(b"fmt ", fmt_body(PCM, 1, 16000, 16)) + chunk(b"LIST", b"x", 10**6),
                                "no data chunk after 46 bytes; the file is cut short or has no samples"),
    "too many chunks": (b"RIFF\0\0\0\0WAVE" + chunk(b"JUNK", b"") * MAX_CHUNKS + chunk(b"fmt ", fmt_body(PCM, 1, 16000, 16)),
                        f"no data chunk among the first {MAX_CHUNKS} chunks"),
    "NaN": (wav(np.array([0.0, np.nan], "<f4"), tag=FLOAT, bits=32), "the float samples hold NaN or infinity"),
    "infinity": (wav(np.array([-np.inf, 0.0], "<f4"), tag=FLOAT, bits=32), "the float samples hold NaN or infinity"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_says_what_it_found(case):
    data, message = REFUSALS[case]
    with pytest.raises(WavError, match=message):
        decode(data)


def test_ten_minutes_are_refused_from_the_header_before_anything_is_decoded():
    """19.2 MB of 16 kHz mono: refused naming both lengths, while allocating next to nothing
    (numpy reports its allocations to tracemalloc)."""
    data = wav(np.zeros(600 * 16000, "<i2"))
    tracemalloc.start()
    try:
        with pytest.raises(WavError, match=r"^600\.0 s of audio; at most 30 s per request$"):
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    # The length is the header's: 30.5 s of NaN float samples is refused for its length, unread.
    with pytest.raises(WavError, match=r"^30\.5 s of audio"):
        decode(wav(np.full(30 * 1000 + 500, np.nan, "<f4"), 1000, tag=FLOAT, bits=32))


def test_exactly_the_limit_is_accepted_and_fills_the_window():
    out = decode(wav(np.zeros(30 * 44100, "<i2"), 44100))
    assert len(out) == 480000


def test_a_header_claiming_gigabytes_allocates_for_the_bytes_present_only():
    data = wav(pcm16(sine(16000, 440, 0.01)), data_size=0xFFFFFFFF)
    tracemalloc.start()
    try:
        decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak


def test_the_byte_bound_holds_the_densest_accepted_file():
    seconds = 30.0
    densest = 30 * 192000 * 2 * 4
    assert max_wav_bytes(seconds) == densest + OTHER_CHUNK_BYTES
    header_and_metadata = len(wav(np.zeros((1, 2), "<f4"), tag=FLOAT, bits=32, extensible=True,
                                  before=chunk(b"LIST", b"\0" * (OTHER_CHUNK_BYTES - 200)))) - 8
    assert densest + header_and_metadata <= max_wav_bytes(seconds)


# --- fuzzed bytes: a WavError or samples, nothing else ----------------------------------------------

VALID = [wav(pcm16(sine(16000, 440, 0.01))), wav(np.stack([sine(44100, 440, 0.01)] * 2, 1).astype("<f4"), 44100,
                                                  tag=FLOAT, bits=32, extensible=True, before=chunk(b"LIST", b"abc"))]


@settings(deadline=None, derandomize=True, database=None, max_examples=400,
          suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(VALID), cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)), max_size=4),
       noise=st.binary(max_size=64))
def test_damaged_files_give_samples_or_a_wav_error(base, cut, flips, noise):
    data = bytearray(base[:max(0, len(base) - cut)] if cut % 2 else base)
    for at, bits in flips:
        if at < len(data):
            data[at] ^= bits
    data = bytes(data) + (noise if cut % 3 == 0 else b"")
    try:
        out = decode(data)
    except WavError:
        return
    assert out.dtype == np.float32 and out.ndim == 1 and len(out) and np.isfinite(out).all()
    assert np.abs(out).max() <= 1.0
