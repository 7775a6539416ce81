"""The streaming fetch: values read one by one from Redis and copied into the slot as they arrive,
on a read thread, while the scheduler's decode runs go on over the other rows."""

from __future__ import annotations

import numpy as np
import pytest

from cachestore.factory import StoreOptions, open_store
from cachestore.prefix import KVGeometry, PrefixStore
from cachestore.redis_store import RedisStore
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.runtime.slots import SharedSlots

B = 16


def test_a_stream_closed_early_leaves_its_connection_clean(redis_url):
    store = open_store(redis_url, StoreOptions(), CacheStats())
    redis = store.inner
    assert isinstance(redis, RedisStore)
    values = {f"stream:{i}": bytes([i]) * (100_000 + i) for i in range(6)}
    redis.put_many(list(values.items()))
    keys = [*values, "stream:missing", "stream:5"]
    stream = store.iter_many(keys)
    assert next(stream) == values["stream:0"] and next(stream) == values["stream:1"]
    stream.close()  # four values and a nil still unread: drained, not left for the next command
    assert store.get_many(keys) == [*values.values(), None, values["stream:5"]]
    assert list(store.iter_many(keys)) == [*values.values(), None, values["stream:5"]]
    assert len(redis._client.connection_pool._connections) == 1, "one connection, back in the pool after each use"
    assert store.stats.store_errors == {}
    store.close()


def test_a_key_of_another_type_reads_as_a_miss_as_with_mget(redis_url, redis_server):
    store = open_store(redis_url, StoreOptions(), CacheStats())
    store.put("typed:a", b"a")
    with redis_server.client() as client:
        client.rpush("typed:list", "x")
    assert list(store.iter_many(["typed:a", "typed:list", "typed:a"])) == [b"a", None, b"a"]
    assert store.stats.store_errors == {}
    store.close()


@pytest.fixture()
def engine(tiny_model):
    e = Engine.load(tiny_model, EngineOptions(block_size=B), open_store("memory://", StoreOptions(), CacheStats()),
                    CacheStats(), "cpu", 2)
    yield e
    e.close()


def test_blocks_copied_during_a_fetch_survive_decode_runs_over_the_fetching_row(engine):
    """Row 0 fetches (length 0) while row 1 decodes: each decode run writes a dummy token's K/V at
    row 0's position 0. The receiver leaves block 0 to ``begin``, which copies it over them, and the
    request's logits equal computing its prompt."""
    slots, session = engine.slots, engine.session
    assert isinstance(slots, SharedSlots)
    ids = np.random.default_rng(4).integers(3, 500, size=4 * B + 5).tolist()
    cold_logits, cold = session.run(ids, session.empty_cache(len(ids)))
    geometry = KVGeometry(engine.spec.num_layers, engine.spec.num_kv_heads, engine.spec.head_size, np.dtype(np.float32))
    prefix = PrefixStore(engine.store, geometry, CacheStats())
    namespace = engine.namespace("")
    hashes = prefix.hashes(namespace, ids)
    prefix.publish(hashes, session.to_canonical(cold, 4 * B), 0, B)

    fetching, other = slots.acquire(len(ids)), slots.acquire(40)
    assert (fetching.index, other.index) == (0, 1)
    slots.begin(other, [], 0)
    token = int(np.argmax(slots.prefill(other, list(range(3, 30)))))
    lookup = prefix.lookup(namespace, ids, slots.receiver(fetching))
    assert lookup.hit_blocks == 4 and len(lookup.blocks) == 1, "only block 0 is kept for begin"
    before = slots.canonical(fetching, 0, 1).result()
    for _ in range(3):
        token = int(np.argmax(slots.decode([other], [token])[0]))
    assert not np.array_equal(slots.canonical(fetching, 0, 1).result(), before), "decode runs wrote row 0's position 0"
    slots.begin(fetching, lookup.blocks, 4 * B)
    warm_logits = slots.prefill(fetching, ids[4 * B:])
    assert np.array_equal(warm_logits, cold_logits)


def test_a_fetch_that_outlives_its_slot_writes_nothing_into_the_next_owner(engine):
    slots = engine.slots
    slot = slots.acquire(100)
    receive = slots.receiver(slot)
    slots.release(slot)
    again = slots.acquire(100)
    assert again.index == slot.index
    slots.begin(again, [], 0)
    row_before = slots.canonical(again, 0, B).result()
    g = engine.prefix.geometry
    receive(0, np.full(g.block_shape(B), 7.0, np.float16), g.full)
    receive(1, np.full(g.block_shape(B), 7.0, np.float16), g.full)
    assert np.array_equal(slots.canonical(again, 0, B).result(), row_before)
    assert not np.any(slots.canonical(again, 0, 2 * B).result() == 7.0)


def test_a_value_rejected_mid_stream_is_deleted_even_with_a_one_connection_pool(tiny_model, redis_url, redis_server):
    """The stream holds its pool connection until it is closed: the rejected value's delete comes
    after, so a pool of one connection (fewer than the read threads) still deletes it at once."""
    from cachestore.codec import Expected, ValueKind, decode, dtype_of, encode
    from cachestore.keys import block_key

    stats = CacheStats()
    store = open_store(redis_url, StoreOptions(max_connections=1), stats)
    e = Engine.load(tiny_model, EngineOptions(block_size=B), store, stats, "cpu", 2)
    try:
        ids = np.random.default_rng(6).integers(3, 500, size=5 * B).tolist()
        prefix, namespace = e.prefix, e.namespace("")
        hashes = prefix.hashes(namespace, ids)
        prefix.publish(hashes, np.ones(prefix.geometry.block_shape(5 * B), np.float32), 0, B)
        key = block_key(hashes[2])
        with redis_server.client() as client:
            value = client.get(key)
            tensor = decode(value, Expected(ValueKind.PREFIX_BLOCK, hashes[2], dtype_of(value))).copy()
            tensor[0, 0, 0, 0, 0] = np.nan
            client.set(key, encode(ValueKind.PREFIX_BLOCK, hashes[2], tensor))
            assert prefix.lookup(namespace, ids).hit_blocks == 2
            assert client.get(key) is None, "the rejected value was deleted"
        assert stats.store_errors == {} and stats.rejected_values == {"non_finite": 1}
    finally:
        e.close()
