"""Models with sliding-window layers (``tiny-window``: layers 0 and 1 see the last 40 positions,
layer 2 all of them), served by in-process engines over a real redis-server: what the store keeps
and fetches per layer group, and that every path (cold, warm from another replica, a run cut
short by a missing window value, generation across the window) gives what a full recompute gives."""

import numpy as np
import pytest
from conftest import record_margin, store_options, stream

from cachestore.codec import ValueKind, encode
from cachestore.factory import open_store
from cachestore.keys import block_key, window_block_key
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession

B = 16
WINDOW = 40
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def window_model(model_dirs):
    return model_dirs["tiny-window", KVLayout.SEPARATE]


def make_engine(folder, redis_url, block_size=B) -> Engine:
    """K/V stored in float32, so that warm logits are compared with the recompute's at float
    tolerance (the default float16 storage is measured in test_cache_dtype)."""
    return Engine.load(folder, EngineOptions(block_size=block_size, cache_dtype="float32"),
                       open_store(redis_url, store_options(), CacheStats()), CacheStats(), "cpu", 2)


@pytest.fixture()
def replicas(window_model, redis_url):
    engines = [make_engine(window_model, redis_url) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def run(engine, ids, n=8):
    return stream(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=n, ignore_eos=True,
                                            return_logits=True))


def recomputed(folder, ids, n):
    """Greedy ids and logits from a full recompute of the whole sequence at every step (no cache)."""
    session = DecoderSession(load_model_spec(folder), "cpu", 2)
    seq, logits = list(ids), []
    for _ in range(n):
        step = session.run(seq, session.empty_cache(len(seq)))[0]
        logits.append(step)
        seq.append(int(np.argmax(step)))
    return seq[len(ids):], logits


def test_the_spec_reads_the_windows_from_the_graph(window_model, model_dirs):
    spec = load_model_spec(window_model)
    assert (spec.windows.window, spec.windows.layers, spec.layer_order) == (WINDOW, (0, 1), (2, 0, 1))
    assert load_model_spec(model_dirs["tiny", KVLayout.SEPARATE]).windows.layers == ()


def test_a_warm_fetch_moves_the_full_layers_of_the_run_and_the_windowed_ones_of_its_last_window(replicas,
                                                                                                 window_model,
                                                                                                 monkeypatch):
    """In one batched read: the windowed values of the whole prompt's last window first, then the
    run of the other layers."""
    cold, warm = replicas
    ids = prompt(9 * B + 6)  # 9 full blocks; a continuation at 144 reads positions 105..143: blocks 6-8
    want_ids, want_logits = recomputed(window_model, ids, 8)
    cold_ids, cold_logits, cold_last = run(cold, ids)
    assert cold_ids == want_ids and cold_last.usage.cached_prompt_tokens == 0
    before = warm.cache_stats.bytes_read
    reads, iter_many = [], warm.prefix.store.iter_many
    monkeypatch.setattr(warm.prefix.store, "iter_many",
                        lambda keys, limits=None: reads.append(list(keys)) or iter_many(keys, limits))
    warm_ids, warm_logits, warm_last = run(warm, ids)
    (keys,) = reads
    hashes = warm.prefix.hashes(warm.namespace(""), ids)
    assert keys == [window_block_key(h) for h in hashes[6:]] + [block_key(h) for h in hashes]
    assert warm_last.usage.cached_prompt_tokens == 9 * B and warm_ids == want_ids
    record_margin("windowed warm vs full recompute (tiny-window)", want_logits[0])
    assert max(np.max(np.abs(a - b)) for a, b in zip(warm_logits, want_logits)) <= TOLERANCE
    g = warm.prefix.geometry
    full = len(encode(ValueKind.PREFIX_BLOCK, b"\0" * 32, np.zeros(g.block_shape(B), g.dtype)))
    windowed = len(encode(ValueKind.WINDOW_BLOCK, b"\0" * 32, np.zeros(g.block_shape(B, g.windowed), g.dtype)))
    assert (g.full, g.windowed) == (slice(0, 1), slice(1, 3))
    assert warm.cache_stats.bytes_read - before == 9 * full + 3 * windowed


def test_every_block_is_published_in_both_groups(replicas, redis_url):
    import redis

    cold, _ = replicas
    ids = prompt(4 * B + 1, seed=1)
    run(cold, ids, n=2)
    client = redis.Redis.from_url(redis_url)
    hashes = cold.prefix.hashes(cold.namespace(""), ids)
    assert all(client.exists(block_key(h)) and client.exists(window_block_key(h)) for h in hashes)


def test_a_model_without_windows_fetches_every_layer_in_one_value(model_dirs, redis_url):
    folder = model_dirs["tiny", KVLayout.SEPARATE]
    cold, warm = make_engine(folder, redis_url), make_engine(folder, redis_url)
    try:
        ids = prompt(9 * B + 6, seed=2)
        run(cold, ids, n=2)
        before = warm.cache_stats.bytes_read
        run(warm, ids, n=2)
        g = warm.prefix.geometry
        assert (g.window_layers, g.full) == (0, slice(0, g.num_layers))
        value = len(encode(ValueKind.PREFIX_BLOCK, b"\0" * 32, np.zeros(g.block_shape(B), g.dtype)))
        assert warm.cache_stats.bytes_read - before == 9 * value
    finally:
        cold.close()
        warm.close()


@pytest.mark.parametrize("lost", [8, 6])
def test_a_missing_window_value_ends_the_run_before_its_block(replicas, window_model, redis_url, lost):
    """Block 8's windowed layers gone: a run of 8 blocks needs blocks 5-7 (4 more values read);
    block 6's gone: the run ends at 6 and needs blocks 3-5. The answer is the recompute's."""
    import redis

    cold, warm = replicas
    ids = prompt(9 * B + 6, seed=3)
    run(cold, ids, n=2)
    hashes = cold.prefix.hashes(cold.namespace(""), ids)
    redis.Redis.from_url(redis_url).delete(window_block_key(hashes[lost]))
    got, _, last = run(warm, ids)
    assert last.usage.cached_prompt_tokens == lost * B
    assert warm.cache_stats.window_misses == 1
    assert got == recomputed(window_model, ids, 8)[0]


def test_a_forged_window_value_is_refused_deleted_and_computed(replicas, window_model, redis_url):
    import redis

    cold, warm = replicas
    ids = prompt(9 * B + 6, seed=4)
    run(cold, ids, n=2)
    hashes = cold.prefix.hashes(cold.namespace(""), ids)
    client = redis.Redis.from_url(redis_url)
    g = warm.prefix.geometry
    # A full-group value under a window key: the kind and the shape both give it away.
    client.set(window_block_key(hashes[7]), client.get(block_key(hashes[7])))
    got, _, last = run(warm, ids)
    assert last.usage.cached_prompt_tokens == 7 * B and got == recomputed(window_model, ids, 8)[0]
    assert warm.cache_stats.rejected_values == {"format": 1} and g.window_layers == 2
    assert run(warm, ids)[2].usage.cached_prompt_tokens == 9 * B  # its publish stored a good one


@pytest.mark.parametrize("prompt_tokens", [30, 2 * B + 5])
def test_generation_across_the_window_equals_a_full_recompute(replicas, window_model, prompt_tokens):
    """Positions 40 and on see only the last 40: the decode steps cross that boundary, cold and
    after a warm fetch."""
    cold, warm = replicas
    ids = prompt(prompt_tokens, seed=5)
    want_ids, want_logits = recomputed(window_model, ids, 24)
    for engine in (cold, warm):
        got, logits, _ = run(engine, ids, n=24)
        assert got == want_ids
        assert max(np.max(np.abs(a - b)) for a, b in zip(logits, want_logits)) <= TOLERANCE


def test_model_info_and_the_start_up_log_give_each_layer_groups_bytes(window_model):
    import grpc

    from kvshare.v1 import generator_pb2 as pb
    from kvshare.v1 import generator_pb2_grpc as pb_grpc
    from services.local.worker_process import WorkerProcess

    with WorkerProcess(window_model, "--block-size", str(B)) as worker, grpc.insecure_channel(worker.target) as channel:
        info = pb_grpc.GeneratorStub(channel).GetModelInfo(pb.GetModelInfoRequest())
        log = "\n".join(worker.log_lines)
    per_layer = 2 * 2 * 16  # K and V x kv_heads x head_size elements
    full, windowed = info.layer_groups
    assert (list(full.layers), full.window, full.fetched_over_window) == ([2], 0, False)
    assert (list(windowed.layers), windowed.window, windowed.fetched_over_window) == ([0, 1], WINDOW, True)
    assert (full.kv_bytes_per_token, windowed.kv_bytes_per_token) == (per_layer * 4, 2 * per_layer * 4)
    assert (full.cached_bytes_per_token, windowed.cached_bytes_per_token) == (per_layer * 2, 2 * per_layer * 2)
    assert info.kv_bytes_per_token == full.kv_bytes_per_token + windowed.kv_bytes_per_token
    assert f"layers 0,1 read the last {WINDOW} positions: {2 * per_layer * 4} bytes per token in the slots" in log


def test_a_row_never_copies_positions_another_rows_fetch_left_out(window_model, redis_url):
    """Row A fetched 9 blocks, its windowed layers only from block 6 on; B shares A's first 5
    blocks and finds nothing in the store (flushed). Copying them from A would give B's windowed
    layers positions A never filled: B computes them instead, and answers as the recompute does."""
    import asyncio

    import redis

    from services.engine.scheduler import SchedulerOptions

    publisher = make_engine(window_model, redis_url)
    engine = Engine.load(window_model, EngineOptions(block_size=B, cache_dtype="float32",
                                                     scheduler=SchedulerOptions(max_unread_tokens=2)),
                         open_store(redis_url, store_options(), CacheStats()), CacheStats(), "cpu", 2)
    long = prompt(9 * B + 6, seed=6)
    short = long[: 5 * B] + prompt(2 * B + 3, seed=7)

    async def scenario():
        await publisher.generate(GenerationRequest(prompt_token_ids=long, max_new_tokens=1)).__anext__()
        await publisher.wait_for_publishes()
        holder = engine.generate(GenerationRequest(prompt_token_ids=long, max_new_tokens=500, ignore_eos=True))
        first = await holder.__anext__()  # A decodes (then pauses: nobody reads it) and holds its slot
        redis.Redis.from_url(redis_url).flushall()
        ids, last = [], None
        async for chunk in engine.generate(GenerationRequest(prompt_token_ids=short, max_new_tokens=8,
                                                             ignore_eos=True)):
            ids += chunk.token_ids
            last = chunk
        await holder.aclose()
        return first, ids, last

    try:
        first, ids, last = asyncio.run(scenario())
        assert first.token_ids and engine.cache_stats.block_hits == 9
        assert last.usage.cached_prompt_tokens == 0 and ids == recomputed(window_model, short, 8)[0]
    finally:
        publisher.close()
        engine.close()


def test_signed_window_values_cannot_be_moved_to_another_block(window_model, redis_url):
    """With a fleet signing key the MAC binds each value to its key: block 7's windowed layers
    copied under block 8's window key are refused (signature), deleted, and computed instead."""
    import redis

    from cachestore.signing import Keyring

    keyring = Keyring.from_secrets([("k1", "fleet-secret-" + "a" * 40)])

    def signed():
        stats = CacheStats()
        return Engine.load(window_model, EngineOptions(block_size=B, cache_dtype="float32"),
                           open_store(redis_url, store_options(keyring=keyring), stats), stats, "cpu", 2)

    cold, warm = signed(), signed()
    try:
        ids = prompt(9 * B + 6, seed=8)
        run(cold, ids, n=2)
        hashes = cold.prefix.hashes(cold.namespace(""), ids)
        client = redis.Redis.from_url(redis_url)
        client.set(window_block_key(hashes[8]), client.get(window_block_key(hashes[7])))
        got, _, last = run(warm, ids)
        assert warm.cache_stats.rejected_values == {"signature": 1}
        assert last.usage.cached_prompt_tokens == 8 * B and got == recomputed(window_model, ids, 8)[0]
    finally:
        cold.close()
        warm.close()


def test_without_the_window_fetch_every_block_is_one_value_of_every_layer(window_model, redis_url, caplog):
    """``--window-fetch false``: blocks as for any model (all layers, in the slots' grouped order,
    which the namespace names), never read by a worker that splits them."""
    def plain():
        return Engine.load(window_model, EngineOptions(block_size=B, cache_dtype="float32", window_fetch=False),
                           open_store(redis_url, store_options(), CacheStats()), CacheStats(), "cpu", 2)

    with caplog.at_level("INFO", logger="services.engine.engine"):
        cold, warm, split = plain(), plain(), make_engine(window_model, redis_url)
    assert "layers 0,1 read the last 40 positions" in caplog.text
    assert "stored and fetched with the other layers, for every cached position (--window-fetch false" in caplog.text
    try:
        ids = prompt(9 * B + 6, seed=9)
        run(cold, ids, n=2)
        before = warm.cache_stats.bytes_read
        got, _, last = run(warm, ids)
        g = warm.prefix.geometry
        assert (g.window_layers, last.usage.cached_prompt_tokens) == (0, 9 * B)
        assert got == recomputed(window_model, ids, 8)[0]
        value = len(encode(ValueKind.PREFIX_BLOCK, b"\0" * 32, np.zeros(g.block_shape(B), g.dtype)))
        assert warm.cache_stats.bytes_read - before == 9 * value
        assert warm.namespace("").layout.endswith(";layers=2,0,1") and split.namespace("") != warm.namespace("")
        assert run(split, ids, n=2)[2].usage.cached_prompt_tokens == 0
    finally:
        for e in (cold, warm, split):
            e.close()
