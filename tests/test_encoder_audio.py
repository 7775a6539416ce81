"""encoder_audio on a Whisper folder: the GenAI-built random-weight Whisper of
tests/fixtures/genai_whisper/ (float [1, 80, 3000] audio_features in) copied with Whisper's
preprocessor_config.json beside it. A WAV file becomes faster-whisper's features on an audio
thread, shares the cross-attention cache with the same features sent as a tensor, and every
problem is INVALID_ARGUMENT naming encoder_audio; through gRPC with the default message size too.
The real tiny.en model's transcripts are checked elsewhere, on its own folder."""

import asyncio
import json
import re
import shutil
import threading

import grpc
import numpy as np
import pytest
from conftest import collect
from test_log_mel import DATA, HF_CONFIG, REFERENCE
from test_wav import wav

from cachestore.factory import StoreOptions, open_store
from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.engine.encoder_input import EncoderFeatures, EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest
from services.errors import InvalidRequest
from services.local.worker_process import WorkerProcess

WHISPER_FIXTURE = DATA.parent.parent / "fixtures" / "genai_whisper"
PROMPT = json.loads((WHISPER_FIXTURE / "expected.json").read_text())["decoder_prompt_ids"]
CLIP = (DATA / "clip1.wav").read_bytes()


def ten_minutes() -> bytes:
    """600 s of 16 kHz mono 16-bit silence: 19.2 MB, under the default message size."""
    return wav(np.zeros(600 * 16000, "<i2"))


def eight_bit() -> bytes:
    return wav(np.full(16000, 128, "u1"), bits=8)


@pytest.fixture(scope="module")
def whisper_audio(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "whisper-audio"
    shutil.copytree(WHISPER_FIXTURE / "whisper-fp32", folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(HF_CONFIG))
    return folder


def load(folder, url) -> Engine:
    return Engine.load(folder, EngineOptions(), open_store(url, StoreOptions(), CacheStats()), CacheStats(), "cpu", 2)


@pytest.fixture()
def replicas(whisper_audio, redis_url):
    engines = [load(whisper_audio, redis_url) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


def transcribe(engine: Engine, encoder: EncoderRequest):
    tokens, last = collect(engine, GenerationRequest(prompt_token_ids=PROMPT, max_new_tokens=8, ignore_eos=True,
                                                     encoder=encoder))
    return tokens, last.usage


def test_audio_becomes_faster_whispers_features(replicas):
    prepared = replicas[0].prepare(GenerationRequest(prompt_token_ids=PROMPT, max_new_tokens=4,
                                                     encoder=EncoderRequest(audio=CLIP)))
    array = prepared.encoder_input
    assert array.shape == (1, 80, 3000) and array.dtype == np.float32
    frames = int(REFERENCE["frames_clip1"])
    assert np.abs(array[0, :, :frames] - REFERENCE["mel_clip1"]).max() <= 1e-5
    assert (array[0, :, frames:] == 0.0).all()


def test_audio_and_its_features_share_the_cross_cache(replicas):
    a, b = replicas
    by_audio, usage = transcribe(a, EncoderRequest(audio=CLIP))
    assert not usage.encoder_cache_hit and a.encoder.runs == 1
    again, usage = transcribe(b, EncoderRequest(audio=CLIP))
    assert usage.encoder_cache_hit and b.encoder.runs == 0 and again == by_audio
    array = a.prepare(GenerationRequest(prompt_token_ids=PROMPT, max_new_tokens=4,
                                        encoder=EncoderRequest(audio=CLIP))).encoder_input
    tensor = EncoderFeatures(array.shape, "float32", array.astype("<f4").tobytes())
    by_features, usage = transcribe(b, EncoderRequest(features=tensor))
    assert usage.encoder_cache_hit and b.encoder.runs == 0 and by_features == by_audio


PROBLEMS = {
    "8-bit": (lambda: EncoderRequest(audio=eight_bit()),
              "encoder_audio: 8-bit PCM not supported; send 16-bit PCM or 32-bit float"),
    "mp3": (lambda: EncoderRequest(audio=b"ID3\x04 an mp3"),
            "encoder_audio: not a WAV file: starts with b'ID3\\x04 an mp3' (it looks like MP3); send RIFF/WAVE bytes "
            "(e.g. `ffmpeg -i FILE -ac 1 -ar 16000 out.wav`)"),
    "no audio": (lambda: EncoderRequest(),
                 "encoder_audio: model whisper-audio is a speech model: send the audio as encoder_audio (a WAV file; "
                 "from a shell, `kvshare transcribe FILE.wav`)"),
    "ten minutes": (lambda: EncoderRequest(audio=ten_minutes()), "encoder_audio: 600.0 s of audio; at most 30 s per request"),
    # Refused on the event loop, unread: one byte more than the densest 30-s WAV (and 1 MiB of metadata).
    "over the byte bound": (lambda: EncoderRequest(audio=bytes(47_128_577)),
                            "encoder_audio: 47128577 bytes; at most 47128576 (a WAV file of at most 30 s, stereo "
                            "32-bit float at 192000 Hz, and metadata)"),
    "audio and features": (lambda: EncoderRequest(audio=CLIP, features=EncoderFeatures((1, 80, 3000), "float32", bytes(960000))),
                           "encoder_prompt: model whisper-audio is encoder-decoder: exactly one of encoder_prompt, "
                           "encoder_prompt_token_ids, encoder_features, encoder_audio got encoder_features, encoder_audio"),
}


def test_features_whose_encoding_overflows_are_invalid_and_never_cached(replicas):
    a, b = replicas
    loud = EncoderFeatures((1, 80, 3000), "float32", np.full((1, 80, 3000), 3e38, "<f4").tobytes())
    with pytest.raises(InvalidRequest, match="encoder_features: the encoder's output overflows"):
        transcribe(a, EncoderRequest(features=loud))
    tokens, usage = transcribe(b, EncoderRequest(audio=CLIP))
    assert tokens and not usage.encoder_cache_hit, "the worker serves on"


@pytest.mark.parametrize("case", sorted(PROBLEMS))
def test_audio_problems_are_invalid_requests_naming_the_field(replicas, case):
    make, message = PROBLEMS[case]
    request = GenerationRequest(prompt_token_ids=PROMPT, max_new_tokens=4, encoder=make())
    with pytest.raises(InvalidRequest) as info:
        replicas[0].prepare(request)
    assert str(info.value) == message


def test_models_without_audio_refuse_it(load_engine, encdec_model, tiny_model):
    request = GenerationRequest(prompt_token_ids=PROMPT, max_new_tokens=4, encoder=EncoderRequest(audio=CLIP))
    cases = {
        WHISPER_FIXTURE / "whisper-fp32": "model whisper-fp32 takes no audio (its folder has no preprocessor_config.json "
                                          "for a float-input encoder): send encoder_features",
        encdec_model: "send encoder_prompt or encoder_prompt_token_ids",
        tiny_model: "is decoder-only and takes no encoder input",
    }
    for folder, message in cases.items():
        with pytest.raises(InvalidRequest, match=re.escape(message)) as info:
            load_engine(folder).prepare(request)
        assert info.value.field == "encoder_audio"


@pytest.mark.subprocess
def test_audio_over_grpc_with_the_default_message_size(whisper_audio, redis_url):
    with WorkerProcess(whisper_audio, "--cache", redis_url) as worker, grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=6, ignore_eos=True, encoder_audio=CLIP)
        done = complete(stub, request, timeout_s=60)
        assert len(done.token_ids) == 6
        for audio, words in [(ten_minutes(), "600.0 s of audio; at most 30 s per request"),
                             (eight_bit(), "8-bit PCM not supported; send 16-bit PCM or 32-bit float")]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, encoder_audio=audio),
                                   timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert info.value.details() == f"encoder_audio: {words}"
        again = complete(stub, request, timeout_s=60)
        assert again.token_ids == done.token_ids and again.last.usage.encoder_cache_hit


def test_audio_is_decoded_apart_from_text_and_a_flood_of_it_is_refused_at_once(whisper_audio, monkeypatch):
    """One audio thread held by a decode (a gate, not a duration): a request with features, prepared
    on the tokenizer threads, streams to its end meanwhile; audio beyond --max-audio-requests is
    refused at once, before its bytes are read; one client holds at most half the places."""
    from services.engine import encoder_input
    from services.errors import Overloaded

    entered, release = threading.Event(), threading.Event()
    decode = encoder_input.decode_wav

    def held_decode(*args):
        entered.set()
        assert release.wait(60), "the test released the decode"
        return decode(*args)

    monkeypatch.setattr(encoder_input, "decode_wav", held_decode)
    engine = Engine.load(whisper_audio, EngineOptions(audio_threads=1, max_audio_requests=2), MemoryStore(64 << 20),
                         CacheStats(), "cpu", 2)

    def request(encoder: EncoderRequest, client: str) -> GenerationRequest:
        return GenerationRequest(prompt_token_ids=PROMPT, max_new_tokens=4, ignore_eos=True, encoder=encoder,
                                 client=client)

    async def tokens(encoder: EncoderRequest, client: str = "a") -> list[int]:
        return [t async for chunk in engine.generate(request(encoder, client)) for t in chunk.token_ids]

    async def scenario():
        first = asyncio.create_task(tokens(EncoderRequest(audio=CLIP)))
        await asyncio.to_thread(entered.wait, 60)
        with pytest.raises(Overloaded, match="the most one client may .1: half of --max-audio-requests 2"):
            await tokens(EncoderRequest(audio=CLIP))
        second = asyncio.create_task(tokens(EncoderRequest(audio=CLIP), "b"))  # waits for the audio thread
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="--max-audio-requests 2"):
            await tokens(EncoderRequest(audio=CLIP), "c")
        tensor = EncoderFeatures((1, 80, 3000), "float32", np.zeros((1, 80, 3000), "<f4").tobytes())
        assert len(await tokens(EncoderRequest(features=tensor))) == 4, "text-path requests never wait for audio"
        assert not first.done()
        release.set()
        return await first, await second

    try:
        first, second = asyncio.run(scenario())
        assert len(first) == len(second) == 4
    finally:
        release.set()
        engine.close()
