"""Storage dtypes of cached K/V (--cache-dtype): the codec's round trip and checks for each, keys
that never mix dtypes, and answers over half-size K/V against computing the prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import STORED_LOGIT_TOLERANCE, collect, note_margin

from cachestore.codec import (
    CodecError,
    Expected,
    RejectReason,
    ValueKind,
    check_range,
    decode,
    encode,
)
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import block_key
from cachestore.memory import MemoryStore
from cachestore.signed import SignedStore
from cachestore.signing import Keyring
from cachestore.stats import CacheStats
from cachestore.storage_dtype import (
    BFLOAT16,
    DEFAULT,
    STORAGE_DTYPES,
    resolve,
    storage_dtype,
)
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest

B = 16
OWNER = b"o" * 32
BLOCK = (np.random.default_rng(0).standard_normal((2, 2, 2, B, 8)) * 4).astype(np.float32)
KEYRING = Keyring.from_secrets([("k1", "fleet-secret-" + "a" * 40)])


@pytest.mark.parametrize("name", list(STORAGE_DTYPES))
@pytest.mark.parametrize("signed", [False, True])
def test_each_dtype_round_trips_through_the_codec_with_its_checks(name, signed):
    dtype = STORAGE_DTYPES[name]
    narrowed = BLOCK.astype(dtype)
    stats = CacheStats()
    store = SignedStore(MemoryStore(1 << 20), KEYRING, stats) if signed else MemoryStore(1 << 20)
    store.put("k", encode(ValueKind.PREFIX_BLOCK, OWNER, narrowed))
    value = store.get("k")
    tensor = decode(value, Expected(ValueKind.PREFIX_BLOCK, OWNER, dtype, BLOCK.shape, store.authenticated))
    assert tensor.dtype == dtype and np.array_equal(tensor.view(np.uint8), narrowed.view(np.uint8))
    bound = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}[name]
    assert np.all(np.abs(tensor.astype(np.float32) - BLOCK) <= bound * np.abs(BLOCK))
    if not signed:
        damaged = bytearray(value)
        damaged[-1] ^= 1
        with pytest.raises(CodecError) as err:
            decode(bytes(damaged), Expected(ValueKind.PREFIX_BLOCK, OWNER, dtype, BLOCK.shape))
        assert err.value.reason is RejectReason.CHECKSUM


@pytest.mark.parametrize("written", list(STORAGE_DTYPES))
@pytest.mark.parametrize("read", list(STORAGE_DTYPES))
def test_a_value_stored_in_one_dtype_is_never_read_as_another(written, read):
    value = encode(ValueKind.PREFIX_BLOCK, OWNER, BLOCK.astype(STORAGE_DTYPES[written]))
    expect = Expected(ValueKind.PREFIX_BLOCK, OWNER, STORAGE_DTYPES[read], BLOCK.shape)
    if written == read:
        decode(value, expect)
        return
    with pytest.raises(CodecError) as err:
        decode(value, expect)
    assert err.value.reason is RejectReason.FORMAT


@pytest.mark.parametrize("value, reason", [(np.inf, RejectReason.NON_FINITE), (np.nan, RejectReason.NON_FINITE),
                                           (-1e30, RejectReason.OUT_OF_RANGE), (65504.0, RejectReason.OUT_OF_RANGE)])
def test_bfloat16_values_outside_the_codec_range_are_refused(value, reason):
    block = BLOCK.copy()
    block[1, 0, 1, 3, 2] = value  # 65504 rounds up to 65536 in bfloat16
    with pytest.raises(CodecError) as err:
        check_range(block.astype(BFLOAT16))
    assert err.value.reason is reason
    check_range(np.array([65280.0, -65280.0], np.float32).astype(BFLOAT16))


def test_the_two_byte_range_check_finds_the_largest_magnitude_of_any_bit_pattern():
    from cachestore.codec import _largest_magnitude_bits

    rng = np.random.default_rng(8)
    for size in (1, 2, 7, 1000):
        for _ in range(200):
            bits = rng.integers(0, 1 << 16, size=size, dtype=np.uint16)
            bits[rng.random(size) < 0.5] &= 0x7FFF  # all-positive and all-negative tensors too
            if rng.random() < 0.3:
                bits |= 0x8000
            assert _largest_magnitude_bits(bits.view(np.float16)) == int((bits & 0x7FFF).max())


def test_the_default_is_auto_and_unknown_names_are_refused():
    """auto: float16 for float32 models, float32 where their matmuls quantize activations (their
    warm answers would drift from cold ones over float16 K/V: tests/test_real_model.py), a 16-bit
    model's own dtype (its values, unchanged)."""
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    assert EngineOptions().cache_dtype == DEFAULT == "auto"
    assert resolve(DEFAULT, f32, quantized_activations=False) == "float16" and storage_dtype("float16") == f16
    assert resolve(DEFAULT, f32, quantized_activations=True) == "float32"
    assert resolve(DEFAULT, f16, quantized_activations=True) == "float16"
    assert resolve(DEFAULT, BFLOAT16, quantized_activations=False) == "bfloat16"
    assert resolve("bfloat16", f32, quantized_activations=True) == "bfloat16"
    with pytest.raises(ValueError, match="bfloat16"):
        storage_dtype("int8")


def engine(folder, store, cache_dtype: str) -> Engine:
    stats = CacheStats()
    return Engine.load(folder, EngineOptions(block_size=B, cache_dtype=cache_dtype), store, stats, "cpu", 2)


def generate(e: Engine, ids, n=24):
    return collect(e, GenerationRequest(prompt_token_ids=list(ids), max_new_tokens=n, ignore_eos=True))


def greedy_with_margins(e: Engine, ids, n=24) -> tuple[list[int], float]:
    """Greedy tokens and the smallest top-1/top-2 log-probability gap among them (the same gap
    as the logits')."""

    async def run():
        tokens, gaps = [], []
        request = GenerationRequest(prompt_token_ids=list(ids), max_new_tokens=n, ignore_eos=True, logprobs=True,
                                    top_logprobs=2)
        async for chunk in e.generate(request):
            tokens.extend(chunk.token_ids)
            gaps.extend(lp.top[0].logprob - lp.top[1].logprob for lp in chunk.logprobs)
        await e.wait_for_publishes()
        return tokens, min(gaps)

    return asyncio.run(run())


def test_workers_storing_different_dtypes_never_share_blocks(tiny_model, redis_url):
    a, b = (engine(tiny_model, open_store(redis_url, StoreOptions(), CacheStats()), d) for d in ("float32", "bfloat16"))
    ids = np.random.default_rng(11).integers(3, 500, size=5 * B + 3).tolist()
    try:
        generate(a, ids)
        assert a.namespace("").dtype == "float32" and b.namespace("").dtype == "bfloat16"
        assert not set(a.prefix.hashes(a.namespace(""), ids)) & set(b.prefix.hashes(b.namespace(""), ids))
        _, last = generate(b, ids)
        assert last.usage.cached_prompt_tokens == 0, "a bfloat16 worker read float32 blocks"
        _, last = generate(a, ids)
        assert last.usage.cached_prompt_tokens == 5 * B
    finally:
        a.close()
        b.close()


PROMPTS = [np.random.default_rng(seed).integers(3, 500, size=6 * B + 5).tolist() for seed in range(6)]


@pytest.mark.parametrize("name", list(STORAGE_DTYPES))
def test_answers_over_stored_kv_equal_computing_the_prompt(tiny_model, name):
    """float32: the first token's logits are bit-identical to computing the prompt. float16 and
    bfloat16: the same greedy tokens on every prompt, logits within their rounding (the smallest
    top-1/top-2 margin relied on is printed at the end of the run)."""
    store, relied_on = MemoryStore(64 << 20), {}
    warm, cold = engine(tiny_model, store, name), engine(tiny_model, MemoryStore(1 << 20), name)
    try:
        for ids in PROMPTS:
            generate(warm, ids)  # publishes the prompt's 6 blocks in ``name``
            assert all(store.get(block_key(h)) is not None for h in warm.prefix.hashes(warm.namespace(""), ids))
            tokens, last = generate(warm, ids)
            assert last.usage.cached_prompt_tokens == 6 * B
            cold_tokens, gap = greedy_with_margins(cold, ids)
            assert tokens == cold_tokens, f"greedy tokens over {name} K/V differ from computing"
            relied_on[name] = min(gap, relied_on.get(name, np.inf))
            session = cold.session
            cold_logits = session.run(ids, session.empty_cache(len(ids)))[0]
            lookup = warm.prefix.lookup(warm.namespace(""), ids)
            warm_logits = session.run(ids[6 * B:], session.cache_from_blocks(lookup.blocks, 6 * B, len(ids)))[0]
            if name == "float32":
                assert np.array_equal(warm_logits, cold_logits)
            else:
                assert np.max(np.abs(warm_logits - cold_logits)) <= STORED_LOGIT_TOLERANCE[name]
    finally:
        warm.close()
        cold.close()
    note_margin(f"24 greedy tokens over {name} stored K/V, 6 prompts (tiny)", relied_on[name])


@pytest.mark.parametrize("model_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name", list(STORAGE_DTYPES))
def test_every_stored_dtype_widens_into_every_model_dtype(model_dtype, name):
    """A block in any storage dtype lands in a slot of the model's K/V dtype (strided, as a slot
    row is) with the values numpy's own conversion gives; publishing converts the other way."""
    from services.runtime.kv_cast import cast_into, converted

    stored = converted(BLOCK, STORAGE_DTYPES[name])
    assert stored.dtype == STORAGE_DTYPES[name] and np.array_equal(stored.view(np.uint8),
                                                                    BLOCK.astype(STORAGE_DTYPES[name]).view(np.uint8))
    slot = np.zeros((2, 2, 2, 3 * B, 8), model_dtype)
    cast_into(slot[:, :, :, B : 2 * B], stored)
    assert np.array_equal(slot[:, :, :, B : 2 * B], stored.astype(np.float32).astype(model_dtype))
    assert not slot[:, :, :, :B].any() and not slot[:, :, :, 2 * B :].any()


@pytest.fixture(scope="module")
def float16_kv_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with float16 past and present K/V, as fp16 exports have (it computes in
    float32 between Cast nodes)."""
    import shutil

    import onnx
    from onnx import TensorProto, helper

    folder = tmp_path_factory.mktemp("fp16kv") / "model"
    shutil.copytree(tiny_model, folder)
    model = onnx.load(str(folder / "model.onnx"))
    graph, before, after = model.graph, [], []
    for value in graph.input:
        if value.name.startswith("past_key_values"):
            for node in graph.node:
                node.input[:] = [value.name + "_f32" if x == value.name else x for x in node.input]
            before.append(helper.make_node("Cast", [value.name], [value.name + "_f32"], to=TensorProto.FLOAT))
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    for value in graph.output:
        if value.name.startswith("present"):
            for node in graph.node:
                node.output[:] = [value.name + "_f32" if x == value.name else x for x in node.output]
            after.append(helper.make_node("Cast", [value.name + "_f32"], [value.name], to=TensorProto.FLOAT16))
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    nodes = [*before, *graph.node, *after]
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(folder / "model.onnx"))
    return folder


@pytest.mark.parametrize("name", list(STORAGE_DTYPES))
def test_a_float16_kv_model_answers_over_each_stored_dtype_as_computing(float16_kv_model, name):
    store = MemoryStore(64 << 20)
    warm, cold = engine(float16_kv_model, store, name), engine(float16_kv_model, MemoryStore(1 << 20), name)
    try:
        assert warm.session.kv_dtype == np.float16
        for ids in PROMPTS[:3]:
            generate(warm, ids)
            tokens, last = generate(warm, ids)
            assert last.usage.cached_prompt_tokens == 6 * B
            assert tokens == generate(cold, ids)[0]
    finally:
        warm.close()
        cold.close()
