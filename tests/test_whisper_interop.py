"""A Whisper folder made by ONNX Runtime GenAI's own model builder (tests/fixtures/genai_whisper/,
random weights, float audio features in) is served unchanged: kvshare's greedy tokens equal
GenAI's for the same features, and a second replica hits its cross-attention cache."""

import json

import grpc
import numpy as np
import onnxruntime_genai as og
import pytest
from conftest import GENAI_FIXTURES, collect, record_margin

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.engine.encoder_input import EncoderFeatures, EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.local.worker_process import WorkerProcess

FIXTURE = GENAI_FIXTURES.parent / "genai_whisper"
FOLDER = FIXTURE / "whisper-fp32"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
PROMPT = EXPECTED["decoder_prompt_ids"]
NEW_TOKENS = EXPECTED["max_length"] - len(PROMPT)


def features(name: str) -> np.ndarray:
    return np.load(FIXTURE / name)


def as_request(array: np.ndarray) -> EncoderRequest:
    return EncoderRequest(features=EncoderFeatures(tuple(array.shape), "float32", array.astype("<f4").tobytes()))


def genai_greedy(array: np.ndarray) -> list[int]:
    model = og.Model(str(FOLDER))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=EXPECTED["max_length"], min_length=EXPECTED["max_length"],
                              batch_size=1)
    generator = og.Generator(model, params)
    inputs = og.NamedTensors()
    inputs["audio_features"] = array
    generator.set_inputs(inputs)
    generator.append_tokens(PROMPT)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(PROMPT):]


def kvshare_greedy(engine: Engine, array: np.ndarray, **cache):
    tokens, last = collect(engine, GenerationRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                     encoder=as_request(array), cache=CacheControl(**cache)))
    return tokens, last.usage


@pytest.fixture()
def replicas(redis_url):
    engines = [Engine.load(FOLDER, EngineOptions(), open_store(redis_url, StoreOptions(), CacheStats()), CacheStats(),
                           "cpu", 2) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


@pytest.mark.genai
@pytest.mark.parametrize("name", ["features.npy", "features2.npy"])
def test_kvshare_matches_genai_on_builder_whisper_and_shares_cross_kv(replicas, name):
    a, b = replicas
    array = features(name)
    ours, usage_a = kvshare_greedy(a, array)
    assert not usage_a.encoder_cache_hit and a.encoder.runs == 1
    assert ours == genai_greedy(array) == EXPECTED["features"][name]["genai_greedy_ids"]
    again, usage_b = kvshare_greedy(b, array)
    assert usage_b.encoder_cache_hit and b.encoder.runs == 0
    assert again == ours
    session = a.session
    cache = session.empty_cache(len(PROMPT) + len(ours))
    cache.cross = session.cross_values(a.encoder.run(array))
    logits, cache = session.run(PROMPT, cache)
    for token in ours:
        record_margin("kvshare vs onnxruntime-genai (builder whisper)", logits)
        logits, cache = session.run([token], cache)


@pytest.mark.subprocess
def test_whisper_features_over_grpc(redis_url):
    array = features("features.npy")
    with WorkerProcess(FOLDER, "--cache", redis_url) as worker, grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        tensor = pb.Tensor(shape=list(array.shape), dtype="float32", data=array.astype("<f4").tobytes())
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                     encoder_features=tensor)
        done = complete(stub, request, timeout_s=60)
        assert done.token_ids == EXPECTED["features"]["features.npy"]["genai_greedy_ids"]
        bad = pb.Tensor(shape=[1, 80, 2999], dtype="float32", data=b"\0" * (80 * 2999 * 4))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, encoder_features=bad)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3000" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, encoder_prompt="text")))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "encoder_features" in info.value.details()
        bad_tensors = {
            "batch of two": pb.Tensor(shape=[2, 80, 3000], dtype="float32", data=b"\0" * (2 * 80 * 3000 * 4)),
            "overflowing shape": pb.Tensor(shape=[2**62, 4], dtype="float32", data=b""),
            "wrong dtype": pb.Tensor(shape=[1, 80, 3000], dtype="float16", data=b"\0" * (80 * 3000 * 2)),
            "short data": pb.Tensor(shape=[1, 80, 3000], dtype="float32", data=b"\0" * 100),
            "a NaN": pb.Tensor(shape=[1, 80, 3000], dtype="float32",
                               data=np.where(np.arange(80 * 3000) == 7, np.nan, 0).astype("<f4").tobytes()),
            "an infinity": pb.Tensor(shape=[1, 80, 3000], dtype="float32",
                                     data=np.where(np.arange(80 * 3000) == 9, -np.inf, 0).astype("<f4").tobytes()),
        }
        for case, tensor in bad_tensors.items():
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, encoder_features=tensor)))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            assert "encoder_features" in info.value.details(), case
        assert complete(stub, request, timeout_s=60).token_ids == done.token_ids, "still serving"
