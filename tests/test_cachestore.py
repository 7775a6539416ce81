"""cachestore on its own: keys, codec, stores, breaker. No model involved."""

import subprocess
import sys

import numpy as np
import pytest

from cachestore.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from cachestore.codec import CodecError, Expected, ValueKind, decode, encode
from cachestore.factory import StoreOptions, StoreURLError, open_store
from cachestore.keys import Namespace, block_hashes, block_key
from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from cachestore.tiered import TieredStore

NS = Namespace(model_fingerprint="ab" * 32, block_size=4, dtype="float32", layout="L2HTD", salt="")
TOKENS = list(range(100, 114))


def test_block_keys_are_the_same_in_another_process():
    script = (
        "from cachestore.keys import Namespace, block_hashes;"
        f"ns = Namespace(model_fingerprint={NS.model_fingerprint!r}, block_size=4, dtype='float32', layout='L2HTD');"
        f"print(','.join(h.hex() for h in block_hashes(ns, {TOKENS!r})))"
    )
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=".").stdout.strip()
    assert other == ",".join(h.hex() for h in block_hashes(NS, TOKENS))


def test_only_full_blocks_get_hashes_and_the_chain_carries_the_prefix():
    hashes = block_hashes(NS, TOKENS)
    assert len(hashes) == 3 and all(len(h) == 32 for h in hashes)
    changed = block_hashes(NS, [999] + TOKENS[1:])
    assert all(a != b for a, b in zip(hashes, changed)), "a change in block 0 renames every later block"
    assert block_hashes(NS, TOKENS[:8] + [7] * 6)[:2] == hashes[:2]


@pytest.mark.parametrize("field, value", [("salt", "tenant-b"), ("block_size", 8), ("dtype", "float16"),
                                          ("model_fingerprint", "cd" * 32), ("layout", "other"), ("extra", "enc"),
                                          ("tenant", "tenant-b"), ("secret", b"s" * 32)])
def test_every_namespace_field_changes_every_key(field, value):
    other = Namespace(**{**{f: getattr(NS, f) for f in NS.__slots__}, field: value})
    assert not set(block_hashes(NS, TOKENS)) & set(block_hashes(other, TOKENS))


BLOCK = np.random.default_rng(0).standard_normal((2, 2, 2, 4, 8)).astype(np.float32)
OWNER = b"o" * 32
EXPECT = Expected(ValueKind.PREFIX_BLOCK, OWNER, np.dtype(np.float32), BLOCK.shape)


def test_codec_round_trip_is_zero_copy():
    value = encode(ValueKind.PREFIX_BLOCK, OWNER, BLOCK)
    tensor = decode(value, EXPECT)
    assert np.array_equal(tensor, BLOCK)
    assert not tensor.flags.writeable and not tensor.flags.owndata


@pytest.mark.parametrize(("damage", "reason"), [
    ("flip payload", "checksum"), ("flip header", "format"), ("truncate", "format"), ("extend", "format"),
    ("other owner", "owner"), ("other kind", "format"), ("empty", "format"), ("nan", "non_finite"), ("inf", "non_finite"),
    ("huge", "out_of_range"),
])
def test_codec_rejects_damaged_values(damage, reason):
    value = bytearray(encode(ValueKind.PREFIX_BLOCK, OWNER, BLOCK))
    if damage == "flip payload":
        value[-5] ^= 0x10
    elif damage == "flip header":
        value[9] ^= 0x01
    elif damage == "truncate":
        value = value[:-3]
    elif damage == "extend":
        value += b"\0"
    elif damage == "other owner":
        value = bytearray(encode(ValueKind.PREFIX_BLOCK, b"x" * 32, BLOCK))
    elif damage == "other kind":
        value = bytearray(encode(ValueKind.CROSS_KV, OWNER, BLOCK))
    elif damage in ("nan", "inf", "huge"):
        bad = BLOCK.copy()
        bad[1, 1, 1, 3, 7] = {"nan": np.nan, "inf": -np.inf, "huge": 3e38}[damage]
        value = bytearray(encode(ValueKind.PREFIX_BLOCK, OWNER, bad))
    else:
        value = bytearray()
    with pytest.raises(CodecError) as raised:
        decode(bytes(value), EXPECT)
    assert raised.value.reason == reason


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_codec_rejects_non_finite_float16(value):
    block = BLOCK.astype(np.float16)
    block[0, 1, 0, 2, 3] = value
    expect = Expected(ValueKind.PREFIX_BLOCK, OWNER, np.dtype(np.float16), BLOCK.shape)
    with pytest.raises(CodecError) as raised:
        decode(encode(ValueKind.PREFIX_BLOCK, OWNER, block), expect)
    assert raised.value.reason == "non_finite"


def test_codec_accepts_the_largest_float16_values():
    block = BLOCK.copy()
    block[0, 0, 0, 0, :2] = (65504.0, -65504.0)
    assert np.array_equal(decode(encode(ValueKind.PREFIX_BLOCK, OWNER, block), EXPECT), block)
    expect16 = Expected(ValueKind.PREFIX_BLOCK, OWNER, np.dtype(np.float16), BLOCK.shape)
    assert np.array_equal(decode(encode(ValueKind.PREFIX_BLOCK, OWNER, block.astype(np.float16)), expect16),
                          block.astype(np.float16))


def test_memory_store_is_set_if_absent_and_bounded_in_bytes():
    store = MemoryStore(max_bytes=100)
    assert store.put("a", b"x" * 40) and not store.put("a", b"y" * 40)
    assert store.get("a") == b"x" * 40
    store.put("b", b"x" * 40)
    store.get("a")  # a is now the most recently used
    store.put("c", b"x" * 40)
    assert store.get_many(["a", "b", "c"]) == [b"x" * 40, None, b"x" * 40]
    assert store.used_bytes <= 100
    assert not store.put("huge", b"x" * 101)


def test_tiered_store_fills_l1_from_l2():
    l1, l2 = MemoryStore(1000), MemoryStore(1000)
    l2.put("k", b"v")
    tiered = TieredStore(l1, l2)
    assert tiered.get_many(["k", "missing"]) == [b"v", None]
    assert l1.get("k") == b"v"
    assert tiered.put_many([("n", b"w")]) == 1 and l1.get("n") == l2.get("n") == b"w"


def test_breaker_opens_backs_off_and_recovers():
    now = [0.0]
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=2, backoff_ms=100, max_backoff_ms=400), clock=lambda: now[0])
    breaker.failure()
    assert breaker.allow()
    breaker.failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow() and breaker.keeps_calls_away
    now[0] = 0.11
    assert not breaker.keeps_calls_away, "the backoff is over even though no call has come to move the state on"
    assert breaker.allow() and not breaker.allow(), "exactly one probe when half-open"
    assert breaker.keeps_calls_away, "the probe is in flight"
    breaker.failure()
    now[0] = 0.25
    assert not breaker.allow(), "backoff doubled to 200 ms"
    now[0] = 0.32
    assert breaker.allow()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and not breaker.keeps_calls_away


def test_unknown_scheme_is_refused():
    for url, says in [("memcached://x", "is not one of"), ("memory", "has no scheme"),
                      ("tiered+memory://", r"tiered\+ goes before a Redis URL"), ("redis+cluster://", "names no seed node"),
                      # Certificate checks cannot be turned off from the URL.
                      ("rediss://r:6380/0?ssl_cert_reqs=none", r"\?ssl_cert_reqs=none would skip checking"),
                      ("tiered+rediss://r:6380/0?ssl_ca_certs=/ca&SSL_CERT_REQS=Optional", "would skip checking"),
                      ("rediss+cluster://r:6380?ssl_check_hostname=false", "would skip checking")]:
        with pytest.raises(StoreURLError, match=says):
            open_store(url, StoreOptions(), CacheStats())


def test_redis_store_set_nx_ttl_and_mget(redis_url, redis_server):
    stats = CacheStats()
    store = open_store(redis_url, StoreOptions(ttl_s=77), stats)
    assert store.put_many([("a", b"1"), ("b", b"2")]) == 2
    assert store.put_many([("a", b"changed"), ("c", b"3")]) == 1
    assert store.get_many(["a", "b", "c", "d"]) == [b"1", b"2", b"3", None]
    with redis_server.client() as c:
        assert 0 < c.ttl("a") <= 77
    store.close()


def test_unreachable_redis_is_a_miss_and_opens_the_breaker():
    stats = CacheStats()
    store = open_store("redis://127.0.0.1:1", StoreOptions(breaker=BreakerPolicy(2, 60000, 60000)), stats)
    for _ in range(5):
        assert store.get_many([block_key(h) for h in block_hashes(NS, TOKENS)]) == [None] * 3
        assert store.put_many([("k", b"v")]) == 0
    snap = stats.snapshot()
    # Reads and writes each open their own breaker after two failures.
    assert snap["store_errors"] == {"connection": 4} and snap["short_circuited"] == 6


class RefusesWrites(MemoryStore):
    """Answers reads but refuses every write, as a full Redis under noeviction does."""

    def put_many(self, items):
        raise OSError("OOM command not allowed when used memory > 'maxmemory'")


def test_a_store_refusing_writes_still_serves_reads():
    from cachestore.resilient import ResilientStore

    inner = RefusesWrites(1000)
    MemoryStore.put(inner, "held", b"v")
    store = ResilientStore(inner, CacheStats(), BreakerPolicy(2, 60000, 60000))
    for _ in range(5):
        assert store.put_many([("new", b"w")]) == 0
    assert store.write_breaker.state is BreakerState.OPEN
    assert store.get_many(["held"]) == [b"v"] and store.state is BreakerState.CLOSED


def test_unix_socket_and_tiered_urls(tmp_path):
    from services.local.redis_process import RedisServer

    socket_path = tmp_path / "redis.sock"
    with RedisServer(extra_args=("--unixsocket", str(socket_path), "--unixsocketperm", "700")) as server:
        unix = open_store(f"unix://{socket_path}", StoreOptions(), CacheStats())
        assert unix.put("k", b"v") and unix.get("k") == b"v"
        tiered = open_store(f"tiered+{server.url}", StoreOptions(), CacheStats())
        assert tiered.name == "tiered(memory+redis)"
        assert tiered.get_many(["k"]) == [b"v"] and tiered.l1.get("k") == b"v"
        unix.close()
        tiered.close()


def test_one_log_line_per_failure_burst(caplog):
    store = open_store("redis://127.0.0.1:1", StoreOptions(breaker=BreakerPolicy(100, 1, 1)), CacheStats())
    with caplog.at_level("WARNING", logger="cachestore.resilient"):
        for _ in range(10):
            store.get_many(["a"])
    assert len(caplog.records) == 1 and "computing instead" in caplog.records[0].getMessage()


def test_rejected_value_warnings_are_rate_limited(caplog):
    import logging

    from cachestore.ratelimit import RateLimitedLog

    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("kvshare.test.ratelimit"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="kvshare.test.ratelimit"):
        for i in range(246):  # a fault's worth of bad values within one interval
            now[0] = i * 0.04
            limited.warning("cache value %s rejected", i)
        now[0] = 10.0
        limited.warning("cache value %s rejected", "later")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["cache value 0 rejected", "cache value later rejected (and 245 more like it in the last 10 s)"]


def test_a_full_redis_counts_out_of_memory_errors_and_still_serves_reads():
    from services.local.redis_process import RedisServer

    with RedisServer(extra_args=("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")) as server:
        stats = CacheStats()
        store = open_store(server.url, StoreOptions(breaker=BreakerPolicy(1000, 60000, 60000)), stats)
        assert store.put("small", b"x" * 1000)
        for i in range(4):
            store.put_many([(f"big-{i}-{j}", b"x" * (256 << 10)) for j in range(4)])
        assert stats.snapshot()["store_errors"].get("out_of_memory", 0) >= 1
        assert store.get("small") == b"x" * 1000
        store.close()


def test_cross_kv_that_readers_would_refuse_is_never_stored():
    from cachestore.cross import CrossStore

    store, stats = MemoryStore(1 << 20), CacheStats()
    cross = CrossStore(store, stats, max_value_bytes=1 << 20, dtype=BLOCK.dtype)
    bad = BLOCK.copy()
    bad[0, 0, 0, 0, 0] = np.nan
    assert not cross.put(OWNER, bad) and store.used_bytes == 0
    assert cross.put(OWNER, BLOCK) and store.used_bytes > 0


def test_a_value_verified_by_its_mac_skips_only_the_checksum():
    value = bytearray(encode(ValueKind.PREFIX_BLOCK, OWNER, BLOCK))
    value[-60:-56] = np.float32(1.5).tobytes()  # a payload change the checksum would catch
    with pytest.raises(CodecError) as err:
        decode(bytes(value), EXPECT)
    assert err.value.reason == "checksum"
    verified = Expected(ValueKind.PREFIX_BLOCK, OWNER, np.dtype(np.float32), BLOCK.shape, authenticated=True)
    assert decode(bytes(value), verified).reshape(-1)[-15] == 1.5
    value[-4:] = np.float32(np.nan).tobytes()
    with pytest.raises(CodecError) as err:
        decode(bytes(value), verified)
    assert err.value.reason == "non_finite", "every other check still holds"
