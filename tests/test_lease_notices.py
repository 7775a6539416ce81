"""Announcements of a lease holder's progress (Redis pub/sub): a waiting worker looks for blocks
when the holder announces a chunk, and only now and then otherwise; announcements are hints, so
a lost, forged or flooding one costs a look, never an answer. A real redis-server, real ONNX
Runtime sessions; every case waits for states, or asserts that something did not happen before a
time it cannot happen before, never that something is fast."""

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Collection

import pytest
from conftest import wait_until
from test_batching import alone, make_engine, prompt, request, run_stream
from test_single_flight import PREFIX, lease_of

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from cachestore.store import Notices
from services.engine.run_waits import (
    IDLE_POLLS,
    LeaseOptions,
    RunWait,
    RunWaits,
    WaitEnd,
)
from services.local.redis_process import RedisClusterServers

A, B_, C = "kvshare:v1:lease:a", "kvshare:v1:lease:b", "kvshare:v1:lease:c"
POLL_S = 2.0


def test_an_announcement_reaches_the_listeners_of_its_key_only(redis_url):
    store, other = (open_store(redis_url, StoreOptions(), CacheStats()) for _ in range(2))
    heard: queue.Queue[str] = queue.Queue()
    notices = store.notices(heard.put)
    try:
        assert notices.live, "listening to nothing: nothing is missed"
        notices.listen({A})
        assert heard.get(timeout=10) == A, "a confirmed subscription is a hint to look once"
        assert notices.live
        # One connection delivers in the order published: b, had it been delivered, would come first.
        other.announce([B_, A])
        assert heard.get(timeout=10) == A
        notices.listen({C})
        assert heard.get(timeout=10) == C
        other.announce([A, C])
        assert heard.get(timeout=10) == C, "a key no longer listened to is not delivered"
    finally:
        notices.close()
        store.close()
        other.close()


def test_announcements_cross_a_redis_cluster():
    """Channels are not sharded: an announcement to any master reaches a listener on any other,
    whichever slots the keys hash to."""
    keys = {f"kvshare:v1:lease:{i}" for i in range(6)}
    with RedisClusterServers() as cluster:
        stats = CacheStats()
        store, other = open_store(cluster.url, StoreOptions(), CacheStats()), open_store(cluster.url, StoreOptions(), stats)
        heard: queue.Queue[str] = queue.Queue()
        notices = store.notices(heard.put)
        try:
            notices.listen(keys)
            assert {heard.get(timeout=10) for _ in keys} == keys
            assert notices.live
            other.announce(sorted(keys))
            assert {heard.get(timeout=10) for _ in keys} == keys
            assert stats.store_errors == {}
        finally:
            notices.close()
            store.close()
            other.close()


def test_announcements_stop_while_redis_is_down_and_resume_after(redis_server, redis_url):
    store = open_store(redis_url, StoreOptions(), CacheStats())
    heard: queue.Queue[str] = queue.Queue()
    notices = store.notices(heard.put)
    try:
        notices.listen({A})
        assert heard.get(timeout=10) == A
        redis_server.kill()
        try:
            wait_until(lambda: not notices.live, what="the subscription to be known lost")
            store.announce([A])  # fails inside: announcing is best effort
        finally:
            redis_server.start()
        assert heard.get(timeout=10) == A, "subscribed again: a look once"
        assert notices.live
        open_store(redis_url, StoreOptions(), CacheStats()).announce([A])
        assert heard.get(timeout=10) == A
    finally:
        notices.close()
        store.close()


class _Notices(Notices):
    """Announcements the test makes itself (``on_notice``), live until it says otherwise."""

    def __init__(self, on_notice: Callable[[str], None]) -> None:
        self.on_notice = on_notice
        self.keys: set[str] = set()
        self.is_live = True
        self.closed = False

    def listen(self, keys: Collection[str]) -> None:
        self.keys = set(keys)

    @property
    def live(self) -> bool:
        return self.is_live

    def close(self) -> None:
        self.closed = True


def test_a_wait_looks_when_its_key_is_announced_at_most_once_a_poll_and_seldom_otherwise():
    """Polls 2 s apart, so a look without an announcement is 10 s away: each look asserted below
    comes seconds before it could come without one, and each look asserted absent could not
    have come that early."""
    made: list[_Notices] = []
    waits = RunWaits(POLL_S * 1e3, lambda on_notice: made.append(_Notices(on_notice)) or made[-1])
    looks: queue.Queue[float] = queue.Queue()
    ends: queue.Queue[WaitEnd] = queue.Queue()
    arrived = threading.Event()

    def fetch_more() -> int:
        looks.put(time.monotonic())
        return 1 if arrived.is_set() else 0

    wait = RunWait(fetch_more=fetch_more, missing=lambda: 0 if arrived.is_set() else 1, held=lambda: True,
                   cancelled=lambda: False, compute_s=lambda blocks: 3600.0, stall_s=3600.0, first_stall_s=3600.0,
                   pace_blocks=1, on_end=ends.put, key=A)
    try:
        (notices,) = made
        waits.add(wait)
        first = looks.get(timeout=10)  # a new wait looks at once
        assert notices.keys == {A}
        notices.on_notice(B_)  # another key's announcement wakes nobody
        with pytest.raises(queue.Empty):
            looks.get(timeout=1.0)
        notices.on_notice(A)
        second = looks.get(timeout=6)
        assert second - first < POLL_S * IDLE_POLLS, "an announcement brought the look forward"
        notices.on_notice(A)  # a flood of announcements: one look a poll at most
        with pytest.raises(queue.Empty):
            looks.get(timeout=1.0)
        arrived.set()
        assert ends.get(timeout=10) is WaitEnd.COMPLETE
        assert notices.keys == set(), "a wait that ended is no longer listened for"
        assert waits.woken == 2
    finally:
        waits.close()
    assert notices.closed


def test_a_waiter_looks_when_the_holder_announces_its_chunks(tiny_model, redis_server, redis_url):
    """The holder's publishes wait at a gate until the waiter is waiting and subscribed; then the
    waiter, which without announcements would look only every 5 s, is woken by them, takes every
    block and answers as cold."""
    gate = threading.Event()
    holder_store = open_store(redis_url, StoreOptions(), CacheStats())
    put_many = holder_store.put_many
    holder_store.put_many = lambda items: gate.wait() and put_many(items)
    holder = make_engine(tiny_model, holder_store, cache_dtype="float32", max_prefill_tokens_per_step=32,
                         leases=LeaseOptions(wait_factor=100))
    waiter = make_engine(tiny_model, open_store(redis_url, StoreOptions(), CacheStats()), cache_dtype="float32",
                         max_prefill_tokens_per_step=32, leases=LeaseOptions(wait_factor=100, poll_ms=1000))
    ids = prompt(PREFIX, 77)
    answers: dict[str, tuple] = {}

    def ask(name, engine) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(name, asyncio.run(run_stream(engine, request(ids, n=8)))))
        thread.start()
        return thread

    try:
        with redis_server.client() as client:
            threads = [ask("holder", holder)]
            wait_until(lambda: client.exists(lease_of(holder, ids, 0)), what="the holder's lease")
            threads.append(ask("waiter", waiter))
            wait_until(lambda: waiter.waits.waiting == 1 and waiter.waits.woken >= 1,
                       what="the waiter waiting, its subscription confirmed")
            gate.set()
            for thread in threads:
                thread.join(timeout=120)
        assert waiter.cache_stats.lease_waits == {"complete": 1}
        assert waiter.waits.woken >= 2, "the holder's announcements woke the waiter"
        assert answers["waiter"][2].usage.cached_prompt_tokens == PREFIX - 1, "all but the last token, as a warm request"
        assert answers["waiter"][0] == answers["holder"][0] == alone(waiter, request(ids, n=8))[0]
    finally:
        gate.set()
        holder.close()
        waiter.close()
