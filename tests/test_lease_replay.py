"""Leases that cannot be replayed or forged into long waits (issue 33, finding 4). With a signing
key a lease is signed with its expiry: one copied from Redis while a worker held it and written
back later is refused, and a renewal signs a fresh expiry. Without one, a forged lease costs a
waiter at most the wait factor times computing the run, and one look on the trail. A real
redis-server, real ONNX Runtime sessions; the clocks are the test's own or the verdicts are
counters, so nothing depends on this machine's speed."""

import asyncio
import time

import pytest
from test_batching import B, alone, make_engine, prompt, request, run_stream
from test_single_flight import PREFIX, lease_of

from cachestore.factory import StoreOptions, open_store
from cachestore.keys import block_hashes
from cachestore.lease_terms import LeaseFault, LeaseTerms, LeaseValue
from cachestore.signed import SignedStore
from cachestore.signing import Keyring
from cachestore.stats import CacheStats
from services.engine.leases import HeldLeases
from services.engine.run_waits import LeaseOptions

KEYRING = Keyring.from_secrets([("k1", "s" * 32)])


@pytest.mark.parametrize("captured_s", [-600, 600], ids=["expired", "too_far_ahead"])
def test_a_replayed_signed_lease_holds_nobody_back(tiny_model, redis_server, redis_url, monkeypatch, captured_s):
    """The attack: another worker's real lease, read with GET while it held it, written back with
    PX 600000. Signed at another time (its clock then: 10 minutes before, or a clock 10 minutes
    ahead), its signed expiry is past or too far ahead: the victim takes the lease and computes
    at once, without waiting (no lease wait counted at all), and answers as cold."""
    stats = CacheStats()
    store = SignedStore(open_store(redis_url, StoreOptions(), stats), KEYRING, stats)
    engine = make_engine(tiny_model, store, cache_dtype="float32", leases=LeaseOptions(wait_factor=1))
    holder = SignedStore(open_store(redis_url, StoreOptions(), CacheStats()), KEYRING, CacheStats())
    try:
        ids = prompt(PREFIX, 61)
        key = lease_of(engine, ids, 0)
        now = time.time
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: now() + captured_s)
            assert holder.claim(key, b"another-worker.0", 5_000) == b"another-worker.0"
        with redis_server.client() as client:
            captured = client.get(key)
            holder.release(key, b"another-worker.0")
            assert not client.exists(key), "the holder ended its lease"
            client.set(key, captured, px=600_000)
            tokens, _, _ = asyncio.run(run_stream(engine, request(ids, n=8)))
            assert not engine.cache_stats.lease_waits, "nobody waited"
            assert client.get(key) != captured, "the replayed lease was deleted, and the victim took the lease"
        assert stats.rejected_values.get("lease") == 1
        assert tokens == alone(engine, request(ids, n=8))[0]
    finally:
        holder.close()
        engine.close()


def test_a_renewed_signed_lease_carries_a_fresh_expiry_and_an_earlier_copy_expires(redis_server, redis_url):
    """Every chunk the holder publishes renews its leases with a freshly signed expiry, so a copy
    of the lease as it was is worth only what remained of it (plus the clock skew)."""
    clock = [1_000_000.0]
    terms = LeaseTerms(max_ttl_ms=60_000, clock_skew_ms=1_000)
    stats, reader_stats = CacheStats(), CacheStats()
    store = SignedStore(open_store(redis_url, StoreOptions(), stats), KEYRING, stats, terms, clock=lambda: clock[0])
    reader = SignedStore(open_store(redis_url, StoreOptions(), reader_stats), KEYRING, reader_stats, terms,
                         clock=lambda: clock[0])
    first, second = "kvshare:v1:lease:r1", "kvshare:v1:lease:r2"
    try:
        assert store.claim(first, b"w.1", 10_000) == b"w.1"
        leases = HeldLeases(store, b"w.1", 10_000, [first])
        with redis_server.client() as client:
            copied = client.get(first)
            clock[0] += 8.0  # the next chunk, 8 s later
            leases.extend(second)
            renewed = client.get(first)
            assert LeaseValue.unpack(KEYRING.verify(first, copied)).expiry_ms == 1_000_010_000
            assert LeaseValue.unpack(KEYRING.verify(first, renewed)).expiry_ms == 1_000_018_000
            assert LeaseValue.unpack(KEYRING.verify(second, client.get(second))).expiry_ms == 1_000_018_000
            clock[0] += 3.5  # past the copy's expiry and the skew, within the renewed lease's
            assert reader.holder(first) == b"w.1", "the renewed lease holds, with its token unchanged"
            client.set(first, copied, px=600_000)
            assert reader.holder(first) is None, "the copy of the lease as it was has expired"
            assert reader_stats.rejected_values == {"lease": 1}
            client.set(first, renewed, px=600_000)
            leases.end()
            assert not client.exists(first) and not client.exists(second), "the renewed leases are the ones released"
    finally:
        store.close()
        reader.close()


def test_a_lease_is_honoured_only_within_its_signed_lifetime_and_the_clock_skew():
    terms = LeaseTerms(max_ttl_ms=60_000, clock_skew_ms=1_000)
    now = 5_000_000
    assert terms.judge(now - 1_000, now) is None and terms.judge(now + 61_000, now) is None
    assert terms.judge(now - 1_001, now) is LeaseFault.EXPIRED
    assert terms.judge(now + 61_001, now) is LeaseFault.TOO_LONG
    assert terms.ttl_ms(10**9) == 60_000 and terms.ttl_ms(0) == 1
    assert LeaseValue.unpack(LeaseValue(b"w.3", now).pack()) == LeaseValue(b"w.3", now)
    assert LeaseValue.unpack(b"w.3") is None, "a token signed alone (an older worker's lease) is not one"


def pinned_engine(redis_url, folder, ms_per_token: float):
    """An engine on Redis (unsigned) whose prefill pace stays ``ms_per_token`` and whose waits on
    another worker's blocks are recorded (the lease wait, then each look on a trail)."""
    engine = make_engine(folder, open_store(redis_url, StoreOptions(), CacheStats()), cache_dtype="float32",
                         max_prefill_tokens_per_step=32,
                         leases=LeaseOptions(wait_factor=2, first_ms_per_token=ms_per_token))
    side = engine.connector.scheduler_side
    side.pace.observe = lambda tokens, ms: None
    waits, add = [], side.waits.add
    side.waits.add = lambda wait: (waits.append(wait), add(wait))[-1]
    return engine, waits


def forge_leases(engine, redis_server, ids: list[int]) -> None:
    """What an attacker who computed the prompt's keys writes: a lease on every block of it."""
    with redis_server.client() as client:
        for block in range(len(ids) // B):
            client.set(lease_of(engine, ids, block), b"attacker.1", px=600_000)


def test_an_unsigned_forged_lease_costs_the_wait_factor_times_computing_the_run_and_no_more_waits(
        tiny_model, redis_server, redis_url):
    """Without a signing key anyone can write a lease. The victim waits for its first blocks at most
    the wait factor times its own expected prefill of the run (no floor: the run here is cheap, and
    the old 100 ms floor made a forged lease cost 57x a tiny model's first token), then computes on
    a trail whose looks only read the store, since the "holder" never published a block. The pace
    is pinned, so the bound is a number, not this machine's speed."""
    engine, waits = pinned_engine(redis_url, tiny_model, ms_per_token=0.05)
    try:
        ids = prompt(PREFIX, 71) + prompt(B // 2, 171)
        forge_leases(engine, redis_server, ids)
        tokens, _, last = asyncio.run(run_stream(engine, request(ids, n=8)))
        run_tokens = len(block_hashes(engine.namespace(""), ids)) * B
        assert engine.cache_stats.lease_waits == {"stalled": 1}
        assert waits[0].first_stall_s == pytest.approx(2 * 0.05 * run_tokens / 1e3), (
            "the wait factor times the run's prefill")
        assert len(waits) == 3, "the lease wait, then two looks on the trail"
        assert [look.first_stall_s for look in waits[1:]] == [0.0, 0.0], "looks that read, never wait"
        assert last.usage.cached_prompt_tokens == 0
        assert tokens == alone(engine, request(ids, n=8))[0]
    finally:
        engine.close()
