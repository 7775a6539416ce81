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
FLIP_MARGIN = 2 * FP16_LOGITS
"""Two computations whose logits differ by up to FP16_LOGITS may rank two tokens differently only
where the reference's top two logits lie within twice that: a near tie, which a different kernel's
rounding (CUDA against the CPU, a batched run against one row) may break the other way. Tokens are
judged as the CPU tests judge theirs: equal, or parting only at such a tie."""


def _top_gap(logits: np.ndarray) -> float:
    top2 = np.sort(logits.astype(np.float64))[-2:]
    return float(top2[1] - top2[0])


def _assert_agree(got, want) -> None:
    """``got`` and ``want`` (tokens, logits) of one greedy request computed two ways: the same
    tokens up to the step where they part, if any; logits within FP16_LOGITS up to and including
    that step (the same inputs until then); and they part only at a near tie of ``want``."""
    (tokens, logits), (want_tokens, want_logits) = got, want
    parted = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=True)) if a != b), len(want_tokens))
    compared = min(parted + 1, len(want_tokens))
    assert np.abs(np.asarray(logits[:compared]) - np.asarray(want_logits[:compared])).max() <= FP16_LOGITS
    if parted < len(want_tokens):
        gap = _top_gap(np.asarray(want_logits[parted]))
        assert gap <= FLIP_MARGIN, f"tokens part at step {parted}, where the reference's top two are {gap:.3f} apart"


def _assert_same_or_near_tie(tokens, want_tokens, reference_logits) -> None:
    """Beams and samples return no logits to compare: their tokens are equal, or part where the
    reference's greedy run over the same prompt (``reference_logits``) has a near tie."""
    if tokens != want_tokens:
        gap = min(_top_gap(np.asarray(step)) for step in reference_logits)
        assert gap <= FLIP_MARGIN, f"the tokens part though the reference's smallest top-two gap is {gap:.3f}"


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
        _assert_agree((tokens, logits), (want, want_logits))


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
    _assert_agree((warm_tokens, warm_logits), (cold_tokens, cold_logits))


def test_the_device_agrees_with_the_hosts_reference(on_device, on_host):
    ids = _prompt(3 * B + 2, 9)
    device_tokens, device_logits, _ = _one(on_device, _request(ids, 8))
    host_tokens, host_logits, _ = _one(on_host, _request(ids, 8))
    _assert_agree((device_tokens, device_logits), (host_tokens, host_logits))


def test_samples_beams_and_shares_agree_with_the_hosts(on_device, on_host):
    ids = _prompt(B + 3, 11)
    greedy = _one(on_host, _request(ids, 8))[1]
    beams = GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True, beams=BeamSearch(4))
    _assert_same_or_near_tie(_one(on_device, beams)[0], _one(on_host, beams)[0], greedy)
    samples = _request(ids, 6, n=3)
    _assert_same_or_near_tie(_one(on_device, samples)[0], _one(on_host, samples)[0], greedy)
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
