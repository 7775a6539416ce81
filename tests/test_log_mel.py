"""Whisper's log-mel features from WAV files (services/audio/) against faster-whisper 1.2.1's own,
recorded in tests/data/whisper/features.npz by bench/whisper_references.py: the frames its
transcribe() fed the encoder for each 16 kHz clip, and its decode of the 44.1 kHz stereo copy of
clip4 (PyAV / libswresample)."""

import json
from pathlib import Path

import numpy as np
import pytest

from services.audio.log_mel import AudioFeatures, mel_filters
from services.audio.wav import decode_wav
from services.errors import ModelLoadError

DATA = Path(__file__).resolve().parent / "data" / "whisper"
REFERENCE = np.load(DATA / "features.npz")
CLIPS = [f"clip{i}" for i in range(1, 7)]
WHISPER = AudioFeatures()
HF_CONFIG = {
    "chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80,
    "hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
    "padding_value": 0.0, "processor_class": "WhisperProcessor", "return_attention_mask": False,
    "sampling_rate": 16000,
}
"""openai/whisper-tiny.en's preprocessor_config.json (older copies also carry "mel_filters")."""


def features(name: str) -> np.ndarray:
    return WHISPER.log_mel(decode_wav((DATA / f"{name}.wav").read_bytes(), 16000, WHISPER.max_seconds))


def test_the_mel_filters_are_faster_whispers():
    assert np.array_equal(mel_filters(16000, 400, 80).astype(np.float32), REFERENCE["mel_filters"])


@pytest.mark.parametrize("clip", CLIPS)
def test_features_match_faster_whisper_for_each_clip(clip):
    """Measured: equal to the bit with the same numpy (2.4.6); 1e-5 leaves room for another BLAS."""
    ours = features(clip)
    frames = int(REFERENCE[f"frames_{clip}"])
    assert ours.shape == (1, 80, 3000) and ours.dtype == np.float32
    assert np.abs(ours[0, :, :frames] - REFERENCE[f"mel_{clip}"]).max() <= 1e-5
    assert (ours[0, :, frames:] == 0.0).all(), "padded with padding_value past the audio"


def test_the_44k_stereo_decode_matches_faster_whispers():
    """PyAV converts to 16-bit after resampling, so the two differ by up to half a step of 2**-15
    (measured: max 1.53e-5, mean 5.9e-6); libswresample stops up to one sample earlier at the end
    (measured: 44392 samples here, 44391 there)."""
    ours = decode_wav((DATA / "clip4_44k_stereo.wav").read_bytes(), 16000, 30.0)
    theirs = REFERENCE["decoded_clip4_44k_stereo"]
    assert 0 <= len(ours) - len(theirs) <= 1
    difference = np.abs(ours[:len(theirs)] - theirs)
    assert difference.max() <= 2e-5 and difference.mean() <= 1e-5
    # Against faster-whisper's decode: measured max 0.018 (quiet frames, where 16-bit steps weigh
    # in the log), mean 3.6e-5.
    gap = np.abs(WHISPER.log_mel(ours) - WHISPER.log_mel(theirs))
    assert gap.max() <= 0.05 and gap.mean() <= 2e-4


def test_the_44k_stereo_copy_has_the_features_of_its_16k_original_at_three_quarters():
    """The copy's right channel is at half gain, so the average is 0.75 x clip4: features 0.0625
    lower wherever the floor does not bind. Against the 16 kHz original scaled by 0.75, measured:
    mean 0.0020; max 0.034 below the top two mel bands, 0.24 in them (7.4-8 kHz, where sox's and
    our anti-alias filters cut)."""
    stereo = features("clip4_44k_stereo")
    original = WHISPER.log_mel(0.75 * decode_wav((DATA / "clip4.wav").read_bytes(), 16000, 30.0))
    frames = int(REFERENCE["frames_clip4"])
    gap = np.abs(stereo - original)[0, :, :frames]
    assert gap.mean() <= 0.005
    assert gap[:78].max() <= 0.06 and gap.max() <= 0.35
    assert (stereo[0, :, frames:] == 0.0).all()


def test_thirty_seconds_fill_the_window_and_more_is_refused():
    full = WHISPER.log_mel(np.zeros(480000, np.float32) + 0.01 * np.sin(np.arange(480000, dtype=np.float32)))
    assert full.shape == (1, 80, 3000) and (full[0, :, -1] != 0.0).any()
    with pytest.raises(ValueError, match="480001 samples; one window holds 480000"):
        WHISPER.log_mel(np.zeros(480001, np.float32))


def test_from_folder_reads_hugging_faces_preprocessor_config(tmp_path):
    assert AudioFeatures.from_folder(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**HF_CONFIG, "mel_filters": [[0.0] * 201] * 80}))
    assert AudioFeatures.from_folder(tmp_path) == WHISPER
    large_v3 = {**HF_CONFIG, "feature_size": 128}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(large_v3))
    assert AudioFeatures.from_folder(tmp_path).log_mel(np.zeros(1600, np.float32)).shape == (1, 128, 3000)


@pytest.mark.parametrize("config, message", [
    ("{", "unreadable"),
    (json.dumps({**HF_CONFIG, "n_samples": 16000}), "n_samples 16000 and nb_max_frames 3000 do not follow"),
    (json.dumps({**HF_CONFIG, "hop_length": "160"}), "hop_length is '160', not an integer"),
    (json.dumps({**HF_CONFIG, "chunk_length": 30.5}), "chunk_length is 30.5, not an integer"),
    (json.dumps({**HF_CONFIG, "feature_size": True}), "feature_size is True"),
    (json.dumps({**HF_CONFIG, "n_fft": 0}), "must be positive"),
])
def test_a_malformed_preprocessor_config_stops_the_load(tmp_path, config, message):
    (tmp_path / "preprocessor_config.json").write_text(config)
    with pytest.raises(ModelLoadError, match=message):
        AudioFeatures.from_folder(tmp_path)
