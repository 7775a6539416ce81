"""Encoder-decoder models: the shared cross-attention cache and its namespace rules, against a
real redis-server (in-process engines, and `kvshare serve` replicas)."""

import hashlib
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import STORED_LOGIT_TOLERANCE, collect, record_margin, wait_until

from cachestore.codec import ValueKind, encode
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import cross_key
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.engine.encoder_input import EncoderFeatures, EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.errors import InvalidRequest
from services.local.worker_process import WorkerProcess

B = 16
ENCODER_IDS = list(range(10, 70))
OTHER_ENCODER_IDS = list(range(11, 71))
TOLERANCE = 1e-4


def make_engine(folder, url, **options):
    stats = CacheStats()  # shared by the store and the engine, as in `kvshare serve`
    return Engine.load(folder, EngineOptions(block_size=B, **options), open_store(url, StoreOptions(), stats),
                       stats, "cpu", 2)


def generate(engine, decoder_ids, encoder_ids=ENCODER_IDS, n=12, **cache):
    tokens, last = collect(engine, GenerationRequest(
        prompt_token_ids=decoder_ids, max_new_tokens=n, ignore_eos=True,
        encoder=EncoderRequest(token_ids=encoder_ids), cache=CacheControl(**cache)))
    return tokens, last.usage


@pytest.fixture()
def replicas(encdec_model, redis_url):
    engines = [make_engine(encdec_model, redis_url) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


def test_second_replica_reuses_cross_kv_and_skips_the_encoder(replicas):
    a, b = replicas
    tokens_a, usage_a = generate(a, list(range(100, 140)))
    assert not usage_a.encoder_cache_hit and a.encoder.runs == 1
    tokens_b, usage_b = generate(b, list(range(200, 230)))
    assert usage_b.encoder_cache_hit
    assert b.encoder.runs == 0, "the encoder does not run on a hit"
    fresh, fresh_usage = generate(b, list(range(200, 230)), skip_read=True)
    assert not fresh_usage.encoder_cache_hit and b.encoder.runs == 1
    assert tokens_b == fresh


def test_same_decoder_prompt_under_another_encoder_input_never_hits(replicas):
    a, b = replicas
    decoder_ids = list(range(100, 164))
    generate(a, decoder_ids)
    assert generate(b, decoder_ids)[1].cached_prompt_tokens == 4 * B - 1  # same encoder input: hits
    other, usage = generate(b, decoder_ids, encoder_ids=OTHER_ENCODER_IDS)
    assert usage.cached_prompt_tokens == 0 and not usage.encoder_cache_hit
    assert other == generate(b, decoder_ids, encoder_ids=OTHER_ENCODER_IDS, skip_read=True)[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "too_long"])
def test_damaged_cross_value_is_a_miss_with_correct_output(replicas, redis_server, damage):
    a, b = replicas
    decoder_ids = list(range(100, 120))
    expected, _ = generate(b, decoder_ids, skip_read=True, skip_write=True)
    generate(a, decoder_ids)
    key = cross_key(a.encoder_input_hash("", np.asarray([ENCODER_IDS], np.int64)))
    with redis_server.client() as client:
        value = client.get(key)
        assert value is not None
        if damage == "flip":
            bad = bytearray(value)
            bad[len(bad) // 2] ^= 0x04
            client.set(key, bytes(bad))
        elif damage == "truncate":
            client.set(key, value[:-64])
        elif damage == "too_long":  # well formed and checksummed, but longer than its input gives: never read whole
            h = a.encoder_input_hash("", np.asarray([ENCODER_IDS], np.int64))
            shape = (a.spec.num_layers, 2, a.spec.num_kv_heads, len(ENCODER_IDS) + 1, a.spec.head_size)
            client.set(key, encode(ValueKind.CROSS_KV, h, np.zeros(shape, a.cross.dtype)))
        else:
            generate(a, decoder_ids, salt="tenant-b")
            client.set(key, client.get(cross_key(a.encoder_input_hash("tenant-b", np.asarray([ENCODER_IDS], np.int64)))))
        tokens, usage = generate(b, decoder_ids, skip_write=True)
        assert not usage.encoder_cache_hit and tokens == expected
        reason = {"flip": "checksum", "truncate": "format", "too_long": "oversized"}.get(damage, "owner")
        assert b.cache_stats.rejected_values == {reason: 1}
        assert client.get(key) is None


def test_unreachable_store_still_answers(encdec_model, replicas):
    expected, _ = generate(replicas[0], list(range(100, 120)), skip_read=True, skip_write=True)
    down = make_engine(encdec_model, "redis://127.0.0.1:1")
    tokens, usage = generate(down, list(range(100, 120)))
    assert tokens == expected and not usage.encoder_cache_hit
    down.close()


def test_cached_cross_logits_equal_fresh_ones(replicas):
    a, _ = replicas
    session, encoder = a.session, a.encoder
    array = np.asarray([ENCODER_IDS], np.int64)
    fresh = encoder.run(array)
    h = a.encoder_input_hash("", array)
    assert a.cross.put(h, fresh)
    cached = a.cross.get(h, a.spec.num_layers, a.spec.num_kv_heads, a.spec.head_size, len(ENCODER_IDS))
    decoder_ids = list(range(100, 130))

    def logits(cross):
        cache = session.empty_cache(len(decoder_ids))
        cache.cross = session.cross_values(cross)
        return session.run(decoder_ids, cache)[0]

    cold, warm = logits(fresh), logits(cached)
    record_margin("cached vs fresh cross K/V (encdec tiny)", cold)
    assert np.max(np.abs(cold - warm)) <= STORED_LOGIT_TOLERANCE[a.storage_dtype.name]
    assert int(np.argmax(cold)) == int(np.argmax(warm))


def test_cross_values_over_the_size_limit_are_skipped_not_split(encdec_model, redis_url, redis_server):
    engine = make_engine(encdec_model, redis_url, max_value_bytes=1024)
    generate(engine, [5, 6, 7])
    assert engine.cache_stats.values_too_large == 1
    with redis_server.client() as client:
        assert not client.keys("kvshare:v1:xkv:*")
    engine.close()


@pytest.mark.parametrize("request_fields, field", [
    ({}, "encoder_prompt"),
    ({"prompt": "a", "token_ids": [5]}, "encoder_prompt"),
    ({"features": EncoderFeatures((1, 4), "float32", b"\0" * 16)}, "encoder_features"),
    ({"token_ids": [5, 99999]}, "encoder_prompt_token_ids[1]"),
])
def test_bad_encoder_input_is_refused(replicas, request_fields, field):
    with pytest.raises(InvalidRequest) as info:
        replicas[0].prepare(GenerationRequest(prompt="x", max_new_tokens=4, encoder=EncoderRequest(**request_fields)))
    assert info.value.field == field


def test_decoder_prompt_is_optional(replicas):
    prepared = replicas[0].prepare(GenerationRequest(max_new_tokens=4, encoder=EncoderRequest(prompt="hello")))
    assert prepared.ids == [replicas[0].spec.decoder_start_token_id]


def test_build_model_encoder_decoder_is_deterministic(tmp_path, encdec_model):
    subprocess.run([sys.executable, "-m", "services.cli", "build-model", "--arch", "encoder-decoder", "--preset", "tiny",
                    str(tmp_path / "again")], check=True, capture_output=True, cwd=Path(__file__).resolve().parent.parent)
    digest = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}  # noqa: E731
    assert digest(tmp_path / "again") == digest(encdec_model)


@pytest.mark.subprocess
def test_two_replicas_share_cross_kv_over_grpc(encdec_model, redis_server, redis_url):
    args = ("--cache", redis_url, "--block-size", str(B))
    with WorkerProcess(encdec_model, *args) as wa, WorkerProcess(encdec_model, *args) as wb, \
            grpc.insecure_channel(wa.target) as ca, grpc.insecure_channel(wb.target) as cb, redis_server.client() as client:
        a, b = pb_grpc.GeneratorStub(ca), pb_grpc.GeneratorStub(cb)
        assert a.GetModelInfo(pb.GetModelInfoRequest()).encoder_decoder

        def ask(stub, prompt, **cache):
            request = pb.GenerateRequest(prompt=prompt, encoder_prompt="Translate: the shared document. " * 4,
                                         max_new_tokens=10, ignore_eos=True, cache=pb.CacheOptions(**cache))
            return complete(stub, request, timeout_s=60)

        first = ask(a, "Summary:")
        assert not first.last.usage.encoder_cache_hit
        wait_until(lambda: client.keys("kvshare:v1:xkv:*"), what="replica A's cross K/V publish")
        second = ask(b, "Title:")
        assert second.last.usage.encoder_cache_hit
        assert second.token_ids == ask(b, "Title:", skip_read=True).token_ids
        with pytest.raises(grpc.RpcError) as info:
            list(b.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=3)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "encoder_prompt" in info.value.details()
