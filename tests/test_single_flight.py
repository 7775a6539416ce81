"""Single-flight of a new shared prefix: concurrent requests on one worker compute it once (the
later rows copy it from the earlier one), replicas sharing a store compute it once fleet-wide
(one takes the lease, the others wait for its blocks), and nothing of it can make an answer
wrong or a wait unbounded: a dead holder, a forged lease, Redis down. Real ONNX Runtime sessions,
real worker processes, a real redis-server; every case waits for states, never for durations."""

import asyncio
import threading
import time
import types
from concurrent.futures import Future

import grpc
import numpy as np
import pytest
from conftest import wait_until
from test_batching import B, alone, make_engine, prompt, request, run_stream

from cachestore.codec import ValueKind, encode
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import Namespace, block_hashes, block_key, lease_key
from cachestore.memory import MemoryStore
from cachestore.prefix import KVGeometry, PrefixStore
from cachestore.signed import SignedStore
from cachestore.signing import Keyring
from cachestore.stats import CacheStats
from cachestore.store import KVStore
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.engine import run_waits
from services.engine.leases import Claim, HeldLeases, Tokens
from services.engine.run_waits import LeaseOptions, RunWait, RunWaits, WaitEnd
from services.local.worker_process import WorkerProcess
from services.runtime.kv_layout import KVLayout

PREFIX = 24 * B  # 384 tokens: many prefill chunks of 32
PATIENT = ("--lease-wait-factor", "100")
"""Waits bounded far beyond any machine's pace: a test of who computes must not depend on speed."""


def prefix_and_questions(count: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    return prompt(PREFIX, seed), [prompt(B // 2 + i, seed + 100 + i) for i in range(count)]


@pytest.mark.parametrize("layout", [KVLayout.SEPARATE, KVLayout.COMBINED])
def test_two_concurrent_requests_on_one_worker_compute_their_shared_prefix_once(model_dirs, layout):
    """On shared-buffer rows (separate K/V) and on per-row caches (the combined layout) alike."""
    # A store that keeps nothing: whatever the second request does not compute, it copied from the first's row.
    engine = make_engine(model_dirs["tiny", layout], MemoryStore(0), cache_dtype="float32",
                         max_prefill_tokens_per_step=32)
    try:
        prefix, (qa, qb) = prefix_and_questions(2)
        a, b = request(prefix + qa, n=64), request(prefix + qb, n=64)

        async def both():
            return await asyncio.gather(run_stream(engine, a), run_stream(engine, b))

        (ta, la, ca), (tb, lb, cb) = asyncio.run(both())
        stats = engine.scheduler.stats
        assert stats.prefill_tokens == PREFIX + len(qa) + len(qb), "the shared prefix was computed once"
        assert stats.shared_tokens == PREFIX
        # Which row computes which chunks depends on whose lookup ends first (a read thread's
        # timing): the rows may share the work, but together they copied exactly one prefix.
        assert ca.usage.cached_prompt_tokens + cb.usage.cached_prompt_tokens == PREFIX
        for req, tokens in ((a, ta), (b, tb)):
            assert tokens == alone(engine, req)[0], "an answer over copied K/V equals its cold answer"
    finally:
        engine.close()


def test_identical_prompts_on_one_worker_compute_all_but_the_last_token_once(tiny_model):
    engine = make_engine(tiny_model, MemoryStore(0), cache_dtype="float32", max_prefill_tokens_per_step=32)
    try:
        ids = prompt(PREFIX, 7)

        async def three():
            return await asyncio.gather(*(run_stream(engine, request(ids, n=32)) for _ in range(3)))

        answers = asyncio.run(three())
        # Each request runs at least its last prompt token itself: its logits start its answer.
        assert engine.scheduler.stats.prefill_tokens == PREFIX + 2
        cold = alone(engine, request(ids, n=32))[0]
        assert all(tokens == cold for tokens, _, _ in answers)
    finally:
        engine.close()


def test_each_prefill_chunk_publishes_its_blocks(tiny_model):
    class CountingStore(MemoryStore):
        def __init__(self):
            super().__init__(64 << 20)
            self.writes: list[int] = []

        def put_many(self, items):
            self.writes.append(len(items))
            return super().put_many(items)

    store = CountingStore()
    engine = make_engine(tiny_model, store, max_prefill_tokens_per_step=4 * B)
    try:
        asyncio.run(run_stream(engine, request(prompt(PREFIX, 3), n=2)))
        asyncio.run(engine.wait_for_publishes())
        # One publish per chunk, of the chunk's full blocks: all but its first, then its first.
        assert store.writes == [3, 1] * (PREFIX // (4 * B))
    finally:
        engine.close()


class PausedAfterFirstWrite:
    """A store (the calls ``PrefixStore`` makes) whose first ``put_many`` waits, once written, until
    ``resume`` is set."""

    def __init__(self, inner: KVStore) -> None:
        self.inner, self.authenticated = inner, inner.authenticated
        self.written, self.resume, self.writes = threading.Event(), threading.Event(), []

    def iter_many(self, keys, limits=None):
        return self.inner.iter_many(keys, limits)

    def put_many(self, items):
        count = self.inner.put_many(items)
        self.writes.append([key for key, _ in items])
        if len(self.writes) == 1:
            self.written.set()
            assert self.resume.wait(30)
        return count


@pytest.mark.parametrize("first_block", [0, 2])
def test_a_lookup_during_a_publish_finds_none_of_its_blocks_or_all(redis_url, first_block):
    """A worker arriving mid-publish stops at the publish's first block, whose lease the publisher
    holds, never inside the run at a block nobody holds (it would lease and compute the rest)."""
    geometry = KVGeometry(2, 2, 4, np.dtype(np.float32))
    namespace = Namespace(model_fingerprint="cd" * 32, block_size=4, dtype="float32", layout="L2HTD")
    ids = list(range(6 * 4))
    hashes = block_hashes(namespace, ids)
    kv = np.random.default_rng(0).standard_normal((2, 2, 2, 6 * 4, 4)).astype(np.float32)
    redis = open_store(redis_url, StoreOptions(), CacheStats())
    reader = PrefixStore(redis, geometry, CacheStats())
    if first_block:
        reader.publish(hashes[:first_block], kv[:, :, :, : first_block * 4], 0, 4)
    paused = PausedAfterFirstWrite(redis)
    publish = threading.Thread(target=PrefixStore(paused, geometry, CacheStats()).publish,
                               args=(hashes, kv[:, :, :, first_block * 4 :], first_block, 4))
    publish.start()
    try:
        assert paused.written.wait(30)
        assert paused.writes == [[block_key(h) for h in hashes[first_block + 1 :]]], "the run first"
        assert reader.lookup(namespace, ids).hit_blocks == first_block, "none of the publish's blocks yet"
    finally:
        paused.resume.set()
        publish.join()
    assert paused.writes[1:] == [[block_key(hashes[first_block])]], "then its first block alone"
    found = reader.lookup(namespace, ids)
    assert found.hit_blocks == 6 and np.array_equal(np.concatenate(found.blocks, axis=3), kv)
    redis.close()


def lease_of(engine, ids: list[int], block: int) -> str:
    """The store key of the lease on computing ``ids`` from block ``block`` on, as the worker names it."""
    return lease_key(block_hashes(engine.namespace(""), ids)[block])


@pytest.mark.parametrize("preset", ["tiny", "tiny-window"])
def test_a_second_worker_waits_for_the_lease_holders_blocks(model_dirs, redis_url, preset):
    """With sliding-window layers too: the waiter's run is final only once its wait ends, and
    only then are the windowed layers of its last window read."""
    folder = model_dirs[preset, KVLayout.SEPARATE]
    engines = [make_engine(folder, open_store(redis_url, StoreOptions(), CacheStats()), cache_dtype="float32",
                           max_prefill_tokens_per_step=32, leases=LeaseOptions(wait_factor=100))
               for _ in range(2)]
    try:
        prefix, questions = prefix_and_questions(4, seed=11)
        requests = [request(prefix + q, n=8) for q in questions]

        async def burst():
            return await asyncio.gather(*(run_stream(engines[i % 2], r) for i, r in enumerate(requests)))

        answers = asyncio.run(burst())
        computed = sum(e.scheduler.stats.prefill_tokens for e in engines)
        assert computed == PREFIX + sum(map(len, questions)), "the fleet computed the new prefix once"
        holder, waiter = sorted(engines, key=lambda e: e.scheduler.stats.prefill_tokens, reverse=True)
        assert waiter.scheduler.stats.prefill_tokens == sum(map(len, questions[1::2])) or \
            waiter.scheduler.stats.prefill_tokens == sum(map(len, questions[0::2]))
        # Every wait, on either worker, ended with all blocks there. The holder's worker waits too
        # when its second request's lookup comes after the first one's first chunk was published:
        # it then waits in the store for its sibling's blocks (``Claim.SIBLING``), which depends on
        # the machine's speed, so whether it waited is not asserted, only how its waits ended.
        assert set(waiter.cache_stats.lease_waits) <= {"complete"}
        assert set(holder.cache_stats.lease_waits) <= {"complete"}
        s = waiter.cache_stats
        shared = waiter.scheduler.stats.shared_tokens
        assert s.block_hits + s.blocks_received + shared // B == PREFIX // B * 2, (
            "each waiting request fetched the whole prefix, or copied it from the one that did")
        for req, (tokens, _, _) in zip(requests, answers, strict=True):
            assert tokens == alone(engines[0], req)[0]
    finally:
        for e in engines:
            e.close()


def test_a_dead_holders_lease_is_waited_for_only_until_the_bound(tiny_model, redis_server, redis_url):
    """What a worker killed mid-prefill leaves: its first blocks published and its lease. The
    waiter fetches those blocks, computes the rest once nothing more comes, answers as cold; the
    lease expires on its own."""
    store = open_store(redis_url, StoreOptions(), CacheStats())
    engine = make_engine(tiny_model, store, cache_dtype="float32", max_prefill_tokens_per_step=32,
                         leases=LeaseOptions(wait_factor=1, first_ms_per_token=1))
    try:
        prefix, (question,) = prefix_and_questions(1, seed=21)
        ids = prefix + question
        done_blocks = 8
        asyncio.run(run_stream(engine, request(ids[: done_blocks * B], n=1)))  # the holder's first chunks
        asyncio.run(engine.wait_for_publishes())
        key = lease_of(engine, ids, done_blocks)
        with redis_server.client() as client:
            client.set(key, b"a-worker-that-died", px=60_000)
            tokens, _, last = asyncio.run(run_stream(engine, request(ids, n=8)))
            assert engine.cache_stats.lease_waits.keys() & {"stalled", "slower"}
            assert last.usage.cached_prompt_tokens == done_blocks * B
            assert tokens == alone(engine, request(ids, n=8))[0]
            assert 0 < client.pttl(key) <= 60_000, "the dead holder's lease is left to expire"
            client.pexpire(key, 50)
            wait_until(lambda: not client.exists(key), what="the lease's expiry")
    finally:
        engine.close()


def test_the_holders_pace_is_judged_on_two_chunks_not_one(monkeypatch):
    """A waiter gives up on a holder that looks slower than computing only once as long has passed
    since the holder's first blocks as computing ``pace_blocks`` (two chunks' worth) would take:
    one chunk's interval at a burst's start is noise. The waits read a clock that stands still a
    second after the first blocks, and the thresholds are 0.8 s and 1.6 s, so no machine's speed
    matters."""
    monkeypatch.setattr(run_waits, "time", types.SimpleNamespace(monotonic=lambda: 1001.0))

    def wait(received: int, ms_per_block: float) -> RunWait:
        return RunWait(fetch_more=lambda: 0, missing=lambda: 16, held=lambda: True, cancelled=lambda: False,
                       compute_s=lambda blocks: blocks * ms_per_block / 1e3, stall_s=3600.0, first_stall_s=3600.0,
                       pace_blocks=8, on_end=lambda end: None, received=received,
                       last_progress=1001.0, first_arrival=1000.0, first_batch=4)

    # One chunk (4 blocks) in the second since the first: the 16 missing would come in 4 s against
    # 3.2 s computing, but two chunks' worth of computing (1.6 s) has not passed yet.
    assert RunWaits._step(wait(4 + 4, ms_per_block=200)) is None
    # Computing two chunks' worth takes 0.8 s: past that, one block in a second is judged slower.
    assert RunWaits._step(wait(4 + 1, ms_per_block=100)) is WaitEnd.SLOWER
    assert RunWaits._step(wait(4 + 12, ms_per_block=100)) is None, "12 blocks a second: faster than computing"


def test_a_forged_lease_makes_nobody_wait(tiny_model, redis_server, redis_url):
    stats = CacheStats()
    keyring = Keyring.from_secrets([("k1", "s" * 32)])
    store = SignedStore(open_store(redis_url, StoreOptions(), stats), keyring, stats)
    engine = make_engine(tiny_model, store, cache_dtype="float32", leases=LeaseOptions(wait_factor=100))
    try:
        ids = prompt(PREFIX, 31)
        with redis_server.client() as client:
            client.set(lease_of(engine, ids, 0), b"forged", px=60_000)
        tokens, _, _ = asyncio.run(run_stream(engine, request(ids, n=8)))
        assert not engine.cache_stats.lease_waits, "an unsigned lease holds nobody back"
        assert stats.rejected_values.get("unsigned") == 1
        assert tokens == alone(engine, request(ids, n=8))[0]
    finally:
        engine.close()


def test_lease_claim_holder_and_release_on_redis(redis_url):
    store = open_store(redis_url, StoreOptions(), CacheStats())
    assert store.claim("kvshare:v1:lease:x", b"me", 10_000) == b"me"
    assert store.claim("kvshare:v1:lease:x", b"other", 10_000) == b"me"
    assert store.holder("kvshare:v1:lease:x") == b"me"
    store.release("kvshare:v1:lease:x", b"other")
    assert store.holder("kvshare:v1:lease:x") == b"me", "only the holder ends its lease"
    store.release("kvshare:v1:lease:x", b"me")
    assert store.holder("kvshare:v1:lease:x") is None
    store.close()


@pytest.mark.parametrize("signed", [False, True])
def test_a_holder_making_progress_keeps_its_leases(redis_url, redis_server, signed):
    """Each chunk the holder publishes renews the leases it holds: a lease lives past the holder's
    latest chunk, however slow the machine made the earlier ones; only its own token renews it."""
    stats = CacheStats()
    store = open_store(redis_url, StoreOptions(), stats)
    if signed:
        store = SignedStore(store, Keyring.from_secrets([("k1", "s" * 32)]), stats)
    first, second, other = "kvshare:v1:lease:a", "kvshare:v1:lease:b", "kvshare:v1:lease:c"
    assert store.claim(first, b"w.1", 60_000) == b"w.1"
    assert store.claim(other, b"x.1", 60_000) == b"x.1"
    leases = HeldLeases(store, b"w.1", 60_000, [first])
    with redis_server.client() as client:
        # As if the first chunk had taken two thirds of the TTL: 20 s left, renewals restore 60 s.
        # (Not a few ms left: a lease expiring before the renewal's round trip would make the
        # test depend on the machine's speed.)
        client.pexpire(first, 20_000)
        client.pexpire(other, 20_000)
        leases.extend(second)
        assert client.pttl(first) > 30_000 and client.pttl(second) > 30_000
        store.renew(other, b"w.1", 60_000)  # not its lease: left to expire as it was
        assert 0 < client.pttl(other) <= 20_000
    leases.end()
    assert store.holder(first) is None and store.holder(second) is None
    store.renew(first, b"w.1", 60_000)  # renewing a lease that ended brings nothing back
    assert store.holder(first) is None
    store.close()


def test_burst_over_two_replicas_is_computed_once_and_answers_as_cold(tiny_model, redis_url):
    with WorkerProcess(tiny_model, "--cache", redis_url, "--block-size", str(B), "--cache-dtype", "float32",
                       "--max-prefill-tokens-per-step", "32", *PATIENT) as wa, \
            WorkerProcess(tiny_model, "--cache", redis_url, "--block-size", str(B), "--cache-dtype", "float32",
                          "--max-prefill-tokens-per-step", "32", *PATIENT) as wb:
        prefix, questions = prefix_and_questions(6, seed=41)

        def call(target, ids, **cache):
            with grpc.insecure_channel(target) as channel:
                req = pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True,
                                         cache=pb.CacheOptions(**cache))
                return complete(pb_grpc.GeneratorStub(channel), req, timeout_s=120)

        async def burst():
            loop = asyncio.get_running_loop()
            return await asyncio.gather(*(loop.run_in_executor(None, call, (wa, wb)[i % 2].target, prefix + q)
                                          for i, q in enumerate(questions)))

        answers = asyncio.run(burst())
        computed = sum(len(prefix + q) - r.last.usage.cached_prompt_tokens for q, r in zip(questions, answers, strict=True))
        assert computed == PREFIX + sum(map(len, questions))
        for q, r in zip(questions, answers, strict=True):
            assert r.token_ids == call(wa.target, prefix + q, skip_read=True, skip_write=True).token_ids


def test_redis_down_the_burst_computes_and_answers_as_cold(tiny_model, redis_server, redis_url):
    engines = [make_engine(tiny_model, open_store(redis_url, StoreOptions(), CacheStats()), cache_dtype="float32",
                           max_prefill_tokens_per_step=32, leases=LeaseOptions(wait_factor=100)) for _ in range(2)]
    redis_server.kill()
    try:
        prefix, questions = prefix_and_questions(4, seed=51)
        requests = [request(prefix + q, n=8) for q in questions]

        async def burst():
            return await asyncio.gather(*(run_stream(engines[i % 2], r) for i, r in enumerate(requests)))

        # Only a hang fails on the clock; that nothing waited is what the counters say.
        answers = asyncio.run(asyncio.wait_for(burst(), timeout=600))
        assert not any(e.cache_stats.lease_waits for e in engines), "no lease, no wait"
        assert not any(e.waits.waiting for e in engines)
        for req, (tokens, _, _) in zip(requests, answers, strict=True):
            assert tokens == alone(engines[0], req)[0]
    finally:
        redis_server.start()
        for e in engines:
            e.close()


MARK = 4242.0
"""A forged value: finite, passes the codec; the poisoned prefill below turns it into NaN logits."""


def plant_forged_blocks(engine, store, ids, count):
    """Writes ``count`` forged blocks for ``ids`` (what a writer with Redis access can do unsigned)."""
    for h in block_hashes(engine.namespace(""), ids)[:count]:
        store.put(block_key(h), encode(ValueKind.PREFIX_BLOCK, h, np.full(engine.prefix.geometry.block_shape(B), MARK,
                                                                          np.float32)))


def poison_prefill(engine, only_last_of=None):
    """Emulates K/V that is finite but wrong: a prefill over a row holding forged values returns NaN
    logits (only for the chunk ending at ``only_last_of`` tokens, when given)."""
    real = engine.slots.prefill

    def prefill(slot, tokens, all_positions=False):
        poisoned = bool((engine.slots._kv[:, :, slot.index, :, : slot.length] == MARK).any())
        out = real(slot, tokens, all_positions)
        last = only_last_of is None or slot.length == only_last_of
        return np.full_like(out, np.nan) if poisoned and last else out

    engine.slots.prefill = prefill


def test_a_row_that_copied_forged_kv_from_another_row_computes_cold_too(tiny_model):
    class ServesOnce(MemoryStore):
        """The forged blocks reach the first lookup only (evicted before the second)."""

        def __init__(self):
            super().__init__(64 << 20)
            self.lookups = 0

        def iter_many(self, keys, limits=None):
            self.lookups += 1
            yield from (self.get_many(keys, limits) if self.lookups == 1 else [None] * len(keys))

    store = ServesOnce()
    engine = make_engine(tiny_model, store, cache_dtype="float32", max_prefill_tokens_per_step=64)
    try:
        prefix = prompt(8 * B, 61)
        a, b = request(prefix + prompt(40, 62), n=4), request(prefix + prompt(20, 63), n=4)
        cold_a, cold_b = alone(engine, a)[0], alone(engine, b)[0]
        plant_forged_blocks(engine, store, prefix, 8)
        poison_prefill(engine)

        async def both():
            return await asyncio.gather(run_stream(engine, a), run_stream(engine, b))

        (ta, _, _), (tb, _, _) = asyncio.run(both())
        assert ta == cold_a and tb == cold_b, "neither the reader of forged values nor a row copying them fails"
        assert engine.slots.free == engine.slots.max_batch
    finally:
        engine.close()


def test_blocks_computed_over_distrusted_kv_do_not_stay_in_the_store(tiny_model):
    store = MemoryStore(64 << 20)
    engine = make_engine(tiny_model, store, cache_dtype="float32", max_prefill_tokens_per_step=32)
    try:
        ids = prompt(12 * B + 5, 71)
        want = alone(engine, request(ids, n=6))[0]
        plant_forged_blocks(engine, store, ids, 4)
        # Only the prompt's last chunk shows the damage: the chunks before it were published already.
        poison_prefill(engine, only_last_of=len(ids))
        tokens, _, _ = asyncio.run(run_stream(engine, request(ids, n=6)))
        asyncio.run(engine.wait_for_publishes())
        assert tokens == want
        assert engine.cache_stats.rejected_values == {"bad_output": 1}
        assert not any(store.get(block_key(h)) is not None for h in block_hashes(engine.namespace(""), ids)), (
            "neither the forged blocks nor those computed over them are left")
    finally:
        engine.close()


def test_the_holder_leases_the_block_after_each_chunk_it_publishes(tiny_model, redis_url):
    """A worker that arrives while a prompt is half computed finds its first missing block leased."""
    claims = []

    class Recording(KVStore):
        def __init__(self, inner):
            self.inner = inner

        def get(self, key, limit=None):
            return self.inner.get(key, limit)

        def iter_many(self, keys, limits=None):
            return self.inner.iter_many(keys, limits)

        def put(self, key, value):
            return self.inner.put(key, value)

        def put_many(self, items):
            return self.inner.put_many(items)

        def delete(self, keys):
            self.inner.delete(keys)

        def claim(self, key, token, ttl_ms):
            claims.append(key)
            return self.inner.claim(key, token, ttl_ms)

        def holder(self, key):
            return self.inner.holder(key)

        def release(self, key, token):
            self.inner.release(key, token)

    store = open_store(redis_url, StoreOptions(), CacheStats())
    engine = make_engine(tiny_model, Recording(store), cache_dtype="float32", max_prefill_tokens_per_step=2 * B)
    try:
        ids = prompt(8 * B + 3, 81)
        asyncio.run(run_stream(engine, request(ids, n=1)))
        asyncio.run(engine.wait_for_publishes())
        wait_until(lambda: all(store.holder(k) is None for k in claims), what="the leases' release")
        assert claims == [lease_of(engine, ids, block) for block in (0, 2, 4, 6)]
    finally:
        engine.close()


def test_a_lease_key_holding_a_hash_is_replaced_not_a_failure(redis_server, redis_url):
    stats = CacheStats()
    store = open_store(redis_url, StoreOptions(), stats)
    with redis_server.client() as client:
        client.hset("kvshare:v1:lease:y", "a", "b")
        assert store.holder("kvshare:v1:lease:y") is None
        store.release("kvshare:v1:lease:y", b"me")
        assert client.type("kvshare:v1:lease:y") == b"hash", "releasing leaves what it does not hold"
        assert store.claim("kvshare:v1:lease:y", b"me", 10_000) == b"me"
        assert 0 < client.pttl("kvshare:v1:lease:y") <= 10_000
    assert not stats.store_errors


def test_one_rows_end_never_ends_another_rows_lease(redis_url):
    store = open_store(redis_url, StoreOptions(), CacheStats())
    tokens = Tokens(b"worker")
    first, second = tokens.new(), tokens.new()
    assert tokens.classify(store.claim("kvshare:v1:lease:z", first, 10_000), first) is Claim.HELD
    assert tokens.classify(store.claim("kvshare:v1:lease:z", second, 10_000), second) is Claim.SIBLING
    assert tokens.classify(b"another-worker.0", second) is Claim.OTHER_WORKER
    HeldLeases(store, second, 10_000, ["kvshare:v1:lease:z"]).end()
    assert store.holder("kvshare:v1:lease:z") == first


@pytest.mark.parametrize("layout", [KVLayout.SEPARATE, KVLayout.COMBINED])
def test_a_waiter_that_gave_up_takes_the_blocks_published_meanwhile(model_dirs, layout, redis_server, redis_url):
    """A waiter that stops waiting for the holder's blocks computes them itself, but before each
    chunk it looks in the store for the blocks it is about to compute (the holder is usually ahead
    of it). Here the holder's first block never comes and every later one is in the store: the
    waiter computes one chunk, takes the rest, and answers as cold (on shared-buffer rows and on
    per-row caches)."""
    store = open_store(redis_url, StoreOptions(), CacheStats())
    engine = make_engine(model_dirs["tiny", layout], store, cache_dtype="float32", max_prefill_tokens_per_step=32,
                         leases=LeaseOptions(wait_factor=1, first_ms_per_token=1))
    try:
        prefix, (question,) = prefix_and_questions(1, seed=31)
        ids = prefix + question
        asyncio.run(run_stream(engine, request(ids, n=1)))  # every full block of the prompt published
        asyncio.run(engine.wait_for_publishes())
        hashes = block_hashes(engine.namespace(""), ids)
        with redis_server.client() as client:
            client.delete(block_key(hashes[0]))
            client.set(lease_of(engine, ids, 0), b"a-worker-not-there-yet", px=60_000)
            before = engine.scheduler.stats.prefill_tokens
            tokens, _, last = asyncio.run(run_stream(engine, request(ids, n=8)))
            client.delete(lease_of(engine, ids, 0))
        computed = engine.scheduler.stats.prefill_tokens - before
        assert engine.cache_stats.lease_waits.keys() & {"stalled", "slower"}
        cached = min(len(hashes) * B, len(ids) - 1)
        assert computed == 32 + len(ids) - cached, "one chunk computed, the blocks after it taken from the store"
        assert engine.scheduler.stats.adopted_tokens == cached - 32
        assert last.usage.cached_prompt_tokens == cached - 32
        assert tokens == alone(engine, request(ids, n=8))[0]
    finally:
        engine.close()


class _HeldLeases(MemoryStore):
    """A MemoryStore whose leases a test can hold for another worker (they never expire)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.leases: dict[str, bytes] = {}

    def claim(self, key, token, ttl_ms):
        return self.leases.setdefault(key, token)

    def holder(self, key):
        return self.leases.get(key)

    def release(self, key, token):
        if self.leases.get(key) == token:
            del self.leases[key]


@pytest.mark.parametrize("layout", [KVLayout.SEPARATE, KVLayout.COMBINED])
def test_what_a_look_brought_goes_only_where_the_row_stood_when_it_began(model_dirs, layout):
    """A row on a trail looks for the holder's blocks from position 32; while the look is held
    back, a later request with the same first 3 blocks arrives and the row copies block 2 from it
    and computes on. The blocks the look then brings start at 32, not where the row now stands:
    they are dropped (the next look brings them again), and the answer equals cold."""
    store = _HeldLeases(64 << 20)
    engine = make_engine(model_dirs["tiny", layout], store, cache_dtype="float32", max_prefill_tokens_per_step=32,
                         leases=LeaseOptions(wait_factor=1, first_ms_per_token=1))
    try:
        ids = prompt(PREFIX, 31) + prompt(B // 2, 131)
        other = ids[: 3 * B] + prompt(20, 999)
        cold = alone(engine, request(ids, n=8))[0]
        asyncio.run(run_stream(engine, request(ids, n=8)))
        asyncio.run(engine.wait_for_publishes())
        hashes = block_hashes(engine.namespace(""), ids)
        store.delete([block_key(hashes[0])])
        store.leases[lease_key(hashes[0])] = b"a-worker-not-there-yet"
        gate, looks, real = threading.Event(), [], engine.connector.scheduler_side.look_ahead

        def held_back(seq):
            inner, out = real(seq), Future()
            looks.append(seq.prefilled)
            first = len(looks) == 1
            threading.Thread(target=lambda: (first and gate.wait(), out.set_result(inner.result())),
                             daemon=True).start()
            return out

        engine.connector.scheduler_side.look_ahead = held_back

        def row():
            return next((s for s in engine.scheduler.active if s.prompt == ids), None)

        async def scenario():
            x = asyncio.create_task(run_stream(engine, request(ids, n=8)))
            await until(lambda: len(looks) == 1)
            assert row().prefilled == 32
            w = asyncio.create_task(run_stream(engine, request(other, n=4)))
            await until(lambda: row() is not None and row().prefilled > 3 * B)
            gate.set()
            return await x, await w

        (tokens, _, last), _ = asyncio.run(scenario())
        assert looks[0] == 32 and len(looks) >= 2
        assert engine.scheduler.stats.adopted_tokens == PREFIX - looks[1], "only the look that began where the row stood"
        assert tokens == cold
    finally:
        engine.close()


async def until(done, timeout_s: float = 60.0) -> None:
    """Waits for a state (a bound only against a hang, never a duration the test relies on)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the state was never reached"
        await asyncio.sleep(0.005)
