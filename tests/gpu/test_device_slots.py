"""The slot bank on a CUDA device (``--device cuda``): skipped where no GPU can be used.

Every comparison runs the same float16 folder: batched rows on the device against each row run
alone, warm (cached K/V) against cold, samples, beams and shares against the host's reference of the
same graph, the encoder-decoder cross cache, the copy counter, and a float32 graph refused. Logits
of float16 graphs are compared within ``FP16_LOGITS``: seeded models' logits have a standard
deviation of 16 (``presets.DecoderShape.logit_std``), and float16 keeps about 3 significant digits.
"""

import asyncio

import numpy as np
import pytest
from conftest import stream, stream_async

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from services.engine.encoder_input import EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import BeamSearch, GenerationRequest
from services.errors import ModelLoadError
from services.modelbuild.folder import (
    write_decoder_folder,
    write_encoder_decoder_folder,
)
from services.runtime.kv_layout import KVLayout
from services.runtime.slots import SharedSlots

pytestmark = pytest.mark.cuda

B = 16
FP16_LOGITS = 0.25
"""Largest |logit difference| accepted between two float16 computations of the same tokens."""


def _engine(folder, device: str) -> Engine:
    return Engine.load(folder, EngineOptions(block_size=B), MemoryStore(256 << 20), CacheStats(), device, 2)


@pytest.fixture(scope="module")
def fp16_folder(tmp_path_factory):
    return write_decoder_folder(tmp_path_factory.mktemp("gpu") / "small-fp16", "small", KVLayout.SEPARATE,
                                dtype="float16")


@pytest.fixture(scope="module")
def on_device(fp16_folder):
    engine = _engine(fp16_folder, "cuda")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def on_host(fp16_folder):
    engine = _engine(fp16_folder, "cpu")
    yield engine
    engine.close()


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 2000, size=n).tolist()


def _one(engine: Engine, request: GenerationRequest):
    tokens, logits, last = stream(engine, request)
    return tokens, np.array(logits), last


def _request(ids, n=12, **fields) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=list(ids), max_new_tokens=n, ignore_eos=True, return_logits=True, **fields)


def test_the_bank_is_on_the_device(on_device):
    assert on_device.session.device_name == "cuda:0"
    assert on_device.session.execution_provider == "CUDAExecutionProvider"
    assert isinstance(on_device.slots, SharedSlots), "GQA graphs batch on the device too"


def test_batched_rows_on_the_device_equal_each_row_alone(on_device):
    prompts = [_prompt(20 + 7 * i, 100 + i) for i in range(8)]
    alone = [_one(on_device, _request(p, cache=None)) for p in prompts]

    async def together():
        return await asyncio.gather(*(stream_async(on_device, _request(p)) for p in prompts))

    steps = on_device.runner.stats.decode_steps
    batched = asyncio.run(together())
    assert on_device.runner.stats.max_decode_rows > 1 and on_device.runner.stats.decode_steps > steps
    for (tokens, logits, _), (want, want_logits, _) in zip(batched, alone, strict=True):
        assert tokens == want
        assert np.abs(np.array(logits) - want_logits).max() <= FP16_LOGITS


def test_warm_equals_cold_and_copies_exactly_the_cached_tokens(on_device):
    ids = _prompt(4 * B + 5, 7)
    copied = on_device.session.device.copied.bytes
    before = dict(copied)
    cold_tokens, cold_logits, _ = _one(on_device, _request(ids))
    per_token = on_device.spec.kv_bytes_per_token(on_device.session.kv_dtype.itemsize)
    assert copied["out"] - before["out"] >= 4 * B * per_token
    before = dict(copied)
    warm_tokens, warm_logits, last = _one(on_device, _request(ids))
    assert last.usage.cached_prompt_tokens == 4 * B
    assert copied["in"] - before["in"] == 4 * B * per_token
    assert warm_tokens == cold_tokens
    assert np.abs(warm_logits - cold_logits).max() <= FP16_LOGITS


def test_the_device_agrees_with_the_hosts_reference(on_device, on_host):
    ids = _prompt(3 * B + 2, 9)
    device_tokens, device_logits, _ = _one(on_device, _request(ids, 8))
    host_tokens, host_logits, _ = _one(on_host, _request(ids, 8))
    assert device_tokens == host_tokens
    assert np.abs(device_logits - host_logits).max() <= FP16_LOGITS


def test_samples_beams_and_shares_equal_the_hosts(on_device, on_host):
    ids = _prompt(B + 3, 11)
    beams = GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True, beams=BeamSearch(4))
    assert _one(on_device, beams)[0] == _one(on_host, beams)[0]
    samples = _request(ids, 6, n=3)
    device_tokens = _one(on_device, samples)[0]
    assert device_tokens == _one(on_host, samples)[0]
    within = on_device.session.device.copied.bytes["within"]
    assert within > 0, "forks and reorders copy on the device"


def test_a_float32_graph_is_refused_on_the_device(tmp_path):
    folder = write_decoder_folder(tmp_path / "tiny-fp32", "tiny", KVLayout.SEPARATE)
    with pytest.raises(ModelLoadError, match="--dtype float16"):
        _engine(folder, "cuda")


def test_the_cross_cache_on_the_device(tmp_path):
    folder = write_encoder_decoder_folder(tmp_path / "encdec-fp16", "tiny", dtype="float16")
    store = MemoryStore(64 << 20)
    first = Engine.load(folder, EngineOptions(block_size=B), store, CacheStats(), "cuda", 0)
    second = Engine.load(folder, EngineOptions(block_size=B), store, CacheStats(), "cuda", 0)
    try:
        source = _prompt(40, 13)
        request = GenerationRequest(prompt_token_ids=[1], max_new_tokens=8, ignore_eos=True,
                                    encoder=EncoderRequest(token_ids=source))
        cold = _one(first, request)
        warm = _one(second, request)
        assert warm[2].usage.encoder_cache_hit and second.encoder.runs == 0
        assert warm[0] == cold[0]
    finally:
        first.close()
        second.close()
