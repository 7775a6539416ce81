"""Reads bounded by size, on a real redis-server: a value longer than its reader accepts (planted by
whoever can write to Redis) is a miss, counted as ``oversized`` and deleted, the request computes,
and Redis never sends the value whole: what it sent is counted by the server itself
(``INFO stats`` total_net_output_bytes). And deletes of distrusted values are never dropped,
however many come at once (counted by the server's ``INFO commandstats``).

A module-scoped server of its own: the bytes it sends are this module's alone.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from conftest import collect, store_options
from redis.cluster import RedisCluster

from cachestore.codec import encoded_bytes
from cachestore.cross import CrossStore
from cachestore.factory import VALUE_HEADER_ROOM_BYTES, open_store
from cachestore.keys import block_key, cross_key, lease_key
from cachestore.memory import MemoryStore
from cachestore.signing import Keyring
from cachestore.stats import CacheStats
from cachestore.store import MAX_LEASE_BYTES
from cachestore.tiered import TieredStore
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.engine.kv_connector.deletions import Deletions
from services.engine.kv_connector.publish_queue import PublishQueue
from services.local.redis_process import RedisClusterServers, RedisServer

B = 16
PLANTED = 16 << 20
"""Bytes of the value an attacker plants: far more than any read below may transfer."""
REPLIES = 64 << 10
"""Room for the replies around a bounded read (the DEL's, the INFO that measures, a lease's
announcements): what the server may send beyond the bytes of the value it reads."""
FLEET = Keyring.from_secrets([("k1", "fleet-secret-" + "a" * 40)])


@pytest.fixture(scope="module")
def server():
    with RedisServer() as redis_server:
        yield redis_server


@pytest.fixture()
def client(server):
    with server.client() as c:
        c.flushall()
        yield c


def sent(client) -> int:
    """Bytes the server has sent to all its clients since it started."""
    return client.info("stats")["total_net_output_bytes"]


def del_calls(client) -> int:
    return client.info("commandstats").get("cmdstat_del", {}).get("calls", 0)


@pytest.mark.parametrize("scheme", ["redis", "tiered+redis", "signed"])
def test_a_value_longer_than_its_reader_accepts_is_never_sent_whole(server, client, scheme):
    stats = CacheStats()
    keyring = FLEET if scheme == "signed" else None
    store = open_store(("tiered+" if scheme == "tiered+redis" else "") + server.url,
                       store_options(keyring=keyring), stats)
    key, limit = "kvshare:v1:block:planted", 4096
    client.set(key, b"x" * PLANTED)
    before = sent(client)
    assert store.get(key, limit) is None
    assert sent(client) - before < limit + REPLIES
    assert stats.rejected_values == {"oversized": 1}
    assert client.exists(key) == 0, "deleted, as a value that fails verification is"
    assert store.put(key, b"v" * limit) and store.get(key, limit) == b"v" * limit, "a value within the limit reads"
    store.close()


def test_the_store_wide_bound_holds_when_a_reader_gives_none(server, client):
    stats = CacheStats()
    bound = 1 << 20
    store = open_store(server.url, store_options(max_value_bytes=bound), stats)
    keys = [f"kvshare:v1:block:{name}" for name in ("good", "planted", "also-good", "planted-too")]
    client.mset({keys[0]: b"a" * 100, keys[1]: b"x" * PLANTED, keys[2]: b"b" * bound, keys[3]: b"y" * PLANTED})
    before = sent(client)
    assert store.get(keys[1]) is None
    assert sent(client) - before < bound + VALUE_HEADER_ROOM_BYTES + REPLIES
    assert list(store.iter_many(keys)) == [b"a" * 100, None, b"b" * bound, None]
    assert stats.rejected_values == {"oversized": 2} and client.exists(*keys) == 2
    store.close()


def test_every_read_of_a_batch_is_bounded_by_its_own_limit(server, client):
    stats = CacheStats()
    store = open_store(server.url, store_options(), stats)
    keys = [f"kvshare:v1:block:{i}" for i in range(4)]
    client.mset({keys[0]: b"a" * 10, keys[1]: b"b" * 11, keys[2]: b"c" * 10, keys[3]: b"d" * PLANTED})
    before = sent(client)
    assert store.get_many(keys, [10, 10, 10, 10]) == [b"a" * 10, None, b"c" * 10, None]
    assert sent(client) - before < REPLIES
    assert stats.rejected_values == {"oversized": 2} and client.exists(*keys) == 2
    stream = store.iter_many(keys[:1] + keys[2:3] + ["kvshare:v1:block:missing"], [10, 9, 10])
    assert next(stream) == b"a" * 10
    stream.close()  # the rest read and checked on the way back to the pool: one more is too long
    assert stats.rejected_values == {"oversized": 3} and client.exists(*keys) == 1
    store.close()


def test_a_cluster_reads_each_node_s_values_within_their_limits():
    with RedisClusterServers() as cluster:
        stats = CacheStats()
        store = open_store(cluster.url, store_options(), stats)
        keys = [f"kvshare:v1:block:{i}" for i in range(8)]  # spread over the three masters' slots
        with RedisCluster.from_url(cluster.url.replace("redis+cluster", "redis")) as writer:
            for i, key in enumerate(keys):
                writer.set(key, b"x" * PLANTED if i % 2 else b"v" * 100)
        clients = [node.client() for node in cluster.nodes]
        before = sum(sent(c) for c in clients)
        assert store.get_many(keys, [100] * len(keys)) == [None if i % 2 else b"v" * 100 for i in range(len(keys))]
        assert sum(sent(c) for c in clients) - before < 3 * REPLIES
        assert stats.rejected_values == {"oversized": len(keys) // 2}
        assert sum(c.dbsize() for c in clients) == len(keys) // 2, "the oversized ones deleted on their nodes"
        for c in clients:
            c.close()
        store.close()


def test_memory_and_tiered_stores_read_a_value_over_the_limit_as_a_miss(server, client):
    memory = MemoryStore(1 << 20)
    memory.put("k", b"v" * 100)
    assert memory.get("k", 99) is None and memory.get("k", 100) == b"v" * 100
    assert memory.get_many(["k", "k"], [100, 99]) == [b"v" * 100, None]
    stats = CacheStats()
    tiered = open_store("tiered+" + server.url, store_options(), stats)
    assert isinstance(tiered, TieredStore)
    tiered.put("kvshare:v1:block:t", b"v" * 100)
    assert tiered.get("kvshare:v1:block:t", 99) is None
    assert tiered.get("kvshare:v1:block:t", 100) == b"v" * 100
    tiered.close()


def test_an_empty_value_is_a_miss_and_the_next_write_replaces_it(server, client):
    """GETRANGE answers "" for a missing key: an empty value planted under a block or a lease key
    would otherwise stand for a miss that no set-if-absent write can ever fill."""
    stats = CacheStats()
    store = open_store(server.url, store_options(), stats)
    block, lease = "kvshare:v1:block:empty", lease_key(b"\x01" * 32)
    client.mset({block: b"", lease: b""})
    assert store.get(block) is None and store.holder(lease) is None
    assert store.put(block, b"v") and store.get(block) == b"v"
    assert store.claim(lease, b"w.1", 60_000) == b"w.1"
    store.close()


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_an_oversized_lease_holds_nobody_back_and_is_never_sent_whole(server, client, signed):
    stats = CacheStats()
    store = open_store(server.url, store_options(keyring=FLEET if signed else None), stats)
    lease = lease_key(b"\x02" * 32)
    client.set(lease, b"x" * PLANTED)
    before = sent(client)
    assert store.holder(lease) is None
    client.set(lease, b"x" * PLANTED)
    assert store.claim(lease, b"w.1", 60_000) == b"w.1", "deleted and claimed by the reader"
    assert sent(client) - before < 2 * (MAX_LEASE_BYTES + REPLIES)
    assert stats.rejected_values == {"oversized": 2} and store.holder(lease) == b"w.1"
    store.close()


def test_an_oversized_cross_value_is_a_miss_read_no_further_than_the_input_allows(server, client):
    stats = CacheStats()
    store = open_store(server.url, store_options(), stats)
    cross = CrossStore(store, stats, max_value_bytes=1 << 20, dtype=np.dtype(np.float32))
    shape = dict(layers=2, heads=2, head_dim=8, max_tokens=10)
    kv = np.random.default_rng(0).standard_normal((2, 2, 2, 10, 8)).astype(np.float32)
    planted, legit = b"\x03" * 32, b"\x04" * 32
    client.set(cross_key(planted), b"x" * PLANTED)
    before = sent(client)
    assert cross.get(planted, **shape) is None
    assert sent(client) - before < encoded_bytes(kv.shape, kv.dtype) + REPLIES
    assert stats.rejected_values == {"oversized": 1} and stats.cross_misses == 1
    assert cross.put(legit, kv) and np.array_equal(cross.get(legit, **shape), kv), "the longest legit value reads"
    store.close()


def generate(engine: Engine, ids: list[int], **cache) -> tuple[list[int], object]:
    return collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True,
                                             cache=CacheControl(**cache)))


@pytest.mark.parametrize("scheme", ["redis", "tiered+redis", "signed"])
def test_an_oversized_block_under_a_real_key_is_a_miss_and_the_request_computes(tiny_model, server, client, scheme):
    url = ("tiered+" if scheme == "tiered+redis" else "") + server.url
    engines = []
    for _ in range(2):
        stats = CacheStats()
        store = open_store(url, store_options(keyring=FLEET if scheme == "signed" else None), stats)
        engines.append(Engine.load(tiny_model, EngineOptions(block_size=B), store, stats, "cpu", 2))
    publisher, victim = engines
    try:
        ids = np.random.default_rng(5).integers(3, 500, size=5 * B + 2).tolist()
        cold, _ = generate(victim, ids, skip_read=True, skip_write=True)
        generate(publisher, ids)
        key = block_key(victim.prefix.hashes(victim.namespace(""), ids)[2])
        published = client.strlen(key)
        client.set(key, b"x" * PLANTED)
        before = sent(client)
        answer, last = generate(victim, ids)
        assert sent(client) - before < PLANTED // 4
        assert answer == cold
        assert last.usage.cached_prompt_tokens == 2 * B, "the run stops at the oversized block"
        assert victim.cache_stats.rejected_values == {"oversized": 1}
        asyncio.run(victim.wait_for_publishes())
        assert client.strlen(key) == published, "deleted, and the victim's publish put the real block back"
        assert generate(victim, ids)[1].usage.cached_prompt_tokens == 5 * B
    finally:
        for engine in engines:
            engine.close()


def test_distrust_deletes_are_never_dropped_however_many_come_at_once(server, client):
    """A flood of distrusted requests while the only write thread is held and the publish queue
    is full (where a bounded write is dropped): every key is deleted, those that follow a publish
    only after it, with far fewer DELs than requests, and never more than ``max_keys`` waiting."""
    stats = CacheStats()
    store = open_store(server.url, store_options(), stats)
    writes = PublishQueue(threads=1, max_pending=1, max_pending_bytes=1, cache_stats=stats)
    deletions = Deletions(store, writes, max_keys=64)
    keys = [f"kvshare:v1:block:flood{i}" for i in range(1000)]
    client.mset(dict.fromkeys(keys, b"v"))
    calls = del_calls(client)
    held = threading.Event()
    publish = writes.always(0, held.wait)  # a publish in flight, on the only write thread
    assert writes.bounded(0, lambda: lambda: None) is None, "the queue is full: a bounded write is dropped"
    following, alone = keys[:500], keys[500:]
    for i in range(0, len(following), 5):  # requests that published over forged K/V: after their publish
        deletions.add(following[i:i + 5], publish)
    for i in range(0, len(alone), 5):  # requests with nothing in flight
        deletions.add(alone[i:i + 5], None)
    assert client.exists(*following) == len(following), "not before the publish they follow"
    assert client.exists(*alone) < 64, "the thread adding keys deletes them itself at max_keys gathered"
    held.set()
    asyncio.run(writes.drained())
    writes.close()
    assert client.exists(*keys) == 0
    assert del_calls(client) - calls < 200 // 4, "coalesced: far fewer DELs than requests"
    assert stats.publishes_dropped == 1, "only the bounded write above"
    store.close()
