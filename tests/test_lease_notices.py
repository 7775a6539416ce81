"""Announcements of a lease holder's progress (Redis pub/sub): a waiting worker looks for blocks
when the holder announces a chunk, and only now and then otherwise; announcements are hints, so
a lost, forged or flooding one costs a look, never an answer. A real redis-server, real ONNX
Runtime sessions; every case waits for states (the waits' thread reads a clock the test sets), never
that something is fast; a bounded wait only fails a hung test."""

import asyncio
import queue
import threading
import types
from collections.abc import Callable, Collection

import pytest
import redis
from conftest import wait_until
from test_batching import alone, make_engine, prompt, request, run_stream
from test_single_flight import PREFIX, lease_of

from cachestore import redis_notices
from cachestore.breaker import BreakerState
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import progress_channel
from cachestore.memory import MemoryStore
from cachestore.redis_notices import RedisNotices
from cachestore.stats import CacheStats
from cachestore.store import Notices
from services.engine import run_waits
from services.engine.leases import HeldLeases
from services.engine.run_waits import (
    IDLE_POLLS,
    LeaseOptions,
    RunWait,
    RunWaits,
    WaitEnd,
)
from services.local.redis_process import RedisClusterServers

A, B_, C = (progress_channel(b"worker.%d" % row) for row in range(3))
HUNG_S = 60.0
"""How long a wait that only a hung test outlasts may take."""


def listening(store) -> tuple[Notices, queue.Queue[tuple[str, bool]]]:
    """A subscription of ``store``'s, and the queue of what it heard: (channel, announced)."""
    heard: queue.Queue[tuple[str, bool]] = queue.Queue()
    return store.notices(lambda channel, announced: heard.put((channel, announced))), heard


def test_an_announcement_reaches_the_listeners_of_its_key_only(redis_url):
    store, other = (open_store(redis_url, StoreOptions(), CacheStats()) for _ in range(2))
    notices, heard = listening(store)
    try:
        assert notices.live, "listening to nothing: nothing is missed"
        notices.listen({A})
        assert heard.get(timeout=10) == (A, False), "a confirmed subscription is a hint to look once"
        assert notices.live
        # One connection delivers in the order published: b, had it been delivered, would come first.
        other.announce([B_, A])
        assert heard.get(timeout=10) == (A, True)
        notices.listen({C})
        assert heard.get(timeout=10) == (C, False)
        other.announce([A, C])
        assert heard.get(timeout=10) == (C, True), "a channel no longer listened to is not delivered"
    finally:
        notices.close()
        store.close()
        other.close()


def test_announcements_cross_a_redis_cluster():
    """Channels are not sharded: an announcement to any master reaches a listener on any other,
    whichever slots the channels hash to."""
    channels = {progress_channel(b"worker.%d" % row) for row in range(6)}
    with RedisClusterServers() as cluster:
        stats = CacheStats()
        store, other = open_store(cluster.url, StoreOptions(), CacheStats()), open_store(cluster.url, StoreOptions(), stats)
        notices, heard = listening(store)
        try:
            notices.listen(channels)
            assert {heard.get(timeout=10) for _ in channels} == {(c, False) for c in channels}
            assert notices.live
            other.announce(sorted(channels))
            assert {heard.get(timeout=10) for _ in channels} == {(c, True) for c in channels}
            assert stats.store_errors == {}
        finally:
            notices.close()
            store.close()
            other.close()


def test_announcements_stop_while_redis_is_down_and_resume_after(redis_server, redis_url):
    store, other = (open_store(redis_url, StoreOptions(), CacheStats()) for _ in range(2))
    notices, heard = listening(store)
    try:
        notices.listen({A})
        assert heard.get(timeout=10) == (A, False)
        redis_server.kill()
        try:
            assert heard.get(timeout=10) == (A, False), "the subscription lost: a look once"
            assert not notices.live
            store.announce([A])  # fails inside: announcing is best effort
        finally:
            redis_server.start()
        assert heard.get(timeout=10) == (A, False), "subscribed again: a look once"
        assert notices.live
        other.announce([A])
        assert heard.get(timeout=10) == (A, True)
        assert store.write_breaker.state is BreakerState.CLOSED, "a failed announcement opens no breaker"
    finally:
        notices.close()
        store.close()
        other.close()


def test_an_announcement_with_a_payload_drops_the_subscription_for_a_pause(redis_server, redis_url):
    """Workers announce nothing but the channel: a message that carries bytes is a hostile
    writer's, read once; the subscription is dropped (its listeners poll) and taken again later."""
    store = open_store(redis_url, StoreOptions(), CacheStats())
    notices, heard = listening(store)
    try:
        notices.listen({A})
        assert heard.get(timeout=10) == (A, False)
        with redis_server.client() as client:
            client.publish(A, b"x" * 1_000_000)
        assert heard.get(timeout=10) == (A, False), "dropped: a look once"
        assert heard.get(timeout=10) == (A, False), "subscribed again after the pause"
        assert notices.live
    finally:
        notices.close()
        store.close()


class _Refused:
    """A connection factory for a Redis that refuses every connection; counts the attempts."""

    def __init__(self) -> None:
        self.attempts = 0

    def __call__(self):
        self.attempts += 1
        raise redis.ConnectionError("refused")


def test_a_failed_subscription_pauses_whatever_the_channels_do(monkeypatch):
    """Waits coming and going while the store refuses (an ACL without the channels, a server
    down) do not each try again: one attempt, then a pause (a million seconds here: nothing in the
    test can outlast it), which only ``close`` cuts short: ``close`` waits for the thread as long
    as a hung test would (instead of its 2 s), so the thread has ended when it returns only if the
    pause was cut short."""
    monkeypatch.setattr(redis_notices, "RETRY_S", 1e6)
    monkeypatch.setattr(redis_notices, "CLOSE_S", HUNG_S)
    connect = _Refused()
    notices = RedisNotices(connect, lambda channel, announced: None, "refusing")
    notices.listen({A})
    wait_until(lambda: connect.attempts == 1, timeout_s=HUNG_S, what="the first attempt")
    for channels in ({A, B_}, {B_}, set(), {C}, {A, C}):
        notices.listen(channels)
    assert not notices.live
    notices.close()
    assert not notices._thread.is_alive(), "close cut the pause short"
    assert connect.attempts == 1


class _StuckPubSub:
    """A subscription whose read never returns (a server trickling one byte at a time)."""

    def __init__(self) -> None:
        self.reading, self.release = threading.Event(), threading.Event()

    def subscribe(self, *channels) -> None:
        pass

    def get_message(self, timeout):
        self.reading.set()
        self.release.wait()
        return {"type": "message", "channel": A.encode(), "data": b""}

    def close(self) -> None:
        pass


def test_close_does_not_wait_on_a_read_that_never_ends():
    pubsub, heard = _StuckPubSub(), []
    client = types.SimpleNamespace(pubsub=lambda: pubsub, close=lambda: None)
    notices = RedisNotices(lambda: client, lambda channel, announced: heard.append(channel), "stuck")
    notices.listen({A})
    assert pubsub.reading.wait(10)
    notices.close()  # returns after CLOSE_S with the thread still in its read
    assert notices._thread.is_alive()
    pubsub.release.set()
    notices._thread.join(10)
    assert heard == [], "nothing is called once closed"


class _Notices(Notices):
    """Announcements the test makes itself (``on_notice``), live until it says otherwise."""

    def __init__(self, on_notice: Callable[[str, bool], None]) -> None:
        self.on_notice = on_notice
        self.channels: set[str] = set()
        self.is_live = True
        self.closed = False

    def listen(self, channels: Collection[str]) -> None:
        self.channels = set(channels)

    @property
    def live(self) -> bool:
        return self.is_live

    def close(self) -> None:
        self.closed = True


def waits_with_test_notices(poll_s: float) -> tuple[RunWaits, _Notices]:
    made: list[_Notices] = []
    waits = RunWaits(poll_s * 1e3, lambda on_notice: made.append(_Notices(on_notice)) or made[-1])
    return waits, made[0]


def idle_wait(**fields) -> RunWait:
    """A wait for one block that never comes, bounded far beyond the test unless ``fields`` say."""
    return RunWait(**{"fetch_more": lambda: 0, "missing": lambda: 1, "held": lambda: True, "cancelled": lambda: False,
                      "compute_s": lambda blocks: 3600.0, "stall_s": 3600.0, "first_stall_s": 3600.0,
                      "pace_blocks": 1, "on_end": lambda end: None, "channel": A} | fields)


class _Clock:
    """``time`` for ``run_waits``: ``monotonic()`` says what the test set, and counts its reads so
    that the test can wait until the waits' thread has looked at the time it set."""

    def __init__(self, now: float) -> None:
        self._now = now
        self._reads = 0
        self._cond = threading.Condition()

    def monotonic(self) -> float:
        with self._cond:
            self._reads += 1
            self._cond.notify_all()
            return self._now

    def set(self, now: float) -> int:
        """Sets the time; returns the reads so far (for ``wait_reads``)."""
        with self._cond:
            self._now = now
            return self._reads

    def wait_reads(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._reads >= count, HUNG_S), "the waits' thread stopped reading the time"


def test_a_wait_looks_when_its_channel_is_announced_at_most_once_a_poll_and_seldom_otherwise(monkeypatch):
    """The waits' thread reads a clock the test sets (its own waits between readings are a poll
    or less of real time, so it keeps reading). A look comes at once for a new wait; an
    announcement brings the next look to one poll after the previous one (without it, it is
    ``IDLE_POLLS`` polls away); a flood of announcements still brings one look a poll; and at no
    time the test sets before a look is due is one made."""
    clock = _Clock(1000.0)
    monkeypatch.setattr(run_waits, "time", clock)
    poll = 0.05
    waits, notices = waits_with_test_notices(poll)
    steps: queue.Queue[float] = queue.Queue()
    ends: queue.Queue[WaitEnd] = queue.Queue()
    arrived = threading.Event()

    def fetch_more() -> int:
        steps.put(wait.stepped_at)
        return 1 if arrived.is_set() else 0

    def no_look_until(due: float) -> None:
        """Sets the clock just before ``due`` and lets the thread read it three times: a look
        decided at the first reading would have read it again and called ``fetch_more`` before
        the third. No look is made."""
        clock.wait_reads(clock.set(due - poll / 100) + 3)
        assert steps.empty(), f"a look before {due}"

    wait = idle_wait(fetch_more=fetch_more, missing=lambda: 0 if arrived.is_set() else 1, on_end=ends.put,
                     last_progress=1000.0)
    try:
        waits.add(wait)
        first = steps.get(timeout=HUNG_S)
        assert first == 1000.0, "a new wait looks at once"
        assert notices.channels == {A}
        notices.on_notice(B_, True)
        assert waits.woken == 0 and not wait.noticed, "another channel's announcement wakes nobody"
        notices.on_notice(A, True)
        no_look_until(first + poll)
        clock.set(first + poll)
        second = steps.get(timeout=HUNG_S)
        assert second == first + poll < first + poll * IDLE_POLLS, "the announcement brought the look forward to one poll"
        notices.on_notice(A, True)  # a flood of announcements: one look a poll at most
        notices.on_notice(A, True)
        no_look_until(second + poll)
        clock.set(second + poll)
        third = steps.get(timeout=HUNG_S)
        assert third == second + poll
        # Quiet: no announcement, so the next look is IDLE_POLLS polls away.
        no_look_until(third + poll * IDLE_POLLS)
        clock.set(third + poll * IDLE_POLLS)
        fourth = steps.get(timeout=HUNG_S)
        assert fourth == third + poll * IDLE_POLLS
        arrived.set()
        notices.on_notice(A, False)  # a subscription confirmed: a look, not counted as woken
        no_look_until(fourth + poll)
        clock.set(fourth + poll)
        assert steps.get(timeout=HUNG_S) == fourth + poll
        assert ends.get(timeout=HUNG_S) is WaitEnd.COMPLETE
        assert notices.channels == set(), "a wait that ended is no longer listened for"
        assert waits.woken == 3
    finally:
        waits.close()
    assert notices.closed


def test_a_quiet_wait_is_still_stepped_when_a_bound_falls_due():
    """Announcements live and none coming: a wait is stepped ``IDLE_POLLS`` polls apart, sooner
    when it would stall or turn slower than computing, never sooner than a poll (the clock is
    the wait's own numbers: nothing here is timed)."""
    waits, notices = waits_with_test_notices(0.1)
    try:
        t = 1000.0
        quiet = idle_wait(stepped_at=t, last_progress=t)
        assert waits._due_at(quiet, live=True) == pytest.approx(t + 0.1 * IDLE_POLLS)
        assert waits._due_at(quiet, live=False) == pytest.approx(t + 0.1), "not live: every poll"
        assert waits._due_at(idle_wait(stepped_at=t, noticed=True), live=True) == pytest.approx(t + 0.1)
        stalls = idle_wait(stepped_at=t, last_progress=t - 0.2, first_stall_s=0.45)
        assert waits._due_at(stalls, live=True) == pytest.approx(t + 0.25)
        assert waits._due_at(idle_wait(stepped_at=t, last_progress=t, first_stall_s=0.02), live=True) == \
            pytest.approx(t + 0.1), "never sooner than a poll"
        # 4 blocks came since the first ones, and computing the 14 missing takes 0.7 s: at that pace
        # waiting for them turns slower than computing 0.7 * 4 / 14 = 0.2 s after the first ones.
        pace = idle_wait(stepped_at=t, last_progress=t, first_arrival=t, first_batch=4, received=8,
                         missing=lambda: 14, compute_s=lambda blocks: 0.05 * blocks, pace_blocks=2)
        assert pace.slower_at(14) == pytest.approx(t + 0.2)
        assert waits._due_at(pace, live=True) == pytest.approx(t + 0.2)
    finally:
        waits.close()


class _Announced(MemoryStore):
    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.announced: list[list[str]] = []

    def announce(self, channels) -> None:
        self.announced.append(list(channels))


def test_a_holder_announces_each_chunk_and_its_end_once_on_its_tokens_channel():
    store = _Announced()
    leases = HeldLeases(store, b"worker.7", 60_000, ["kvshare:v1:lease:a"])
    leases.extend("kvshare:v1:lease:b")
    leases.announce()
    leases.end()
    leases.end()
    leases.extend("kvshare:v1:lease:c")  # after the end: neither claimed nor announced
    channel = progress_channel(b"worker.7")
    assert store.announced == [[channel], [channel]]
    assert progress_channel(b"x" * 65) is None and progress_channel(b"a b") is None and progress_channel(b"") is None, (
        "a token no worker makes, read from the store, names no channel")


def test_a_waiter_looks_when_the_holder_announces_its_chunks(tiny_model, redis_server, redis_url):
    """The holder's publishes wait at a gate until the waiter is waiting and subscribed; then the
    waiter, which polls only every 5 s while subscribed, is woken by the announcements, takes every
    block and answers as cold."""
    gate = threading.Event()
    holder_store = open_store(redis_url, StoreOptions(), CacheStats())
    put_many = holder_store.put_many
    holder_store.put_many = lambda items: gate.wait() and put_many(items)
    # A lease of 2 x 100 ms x 384 tokens + 0.5 s: the gate holds up its renewals, not its life.
    holder = make_engine(tiny_model, holder_store, cache_dtype="float32", max_prefill_tokens_per_step=32,
                         leases=LeaseOptions(wait_factor=100, first_ms_per_token=100))
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
            wait_until(lambda: waiter.waits.waiting == 1 and waiter.waits.live,
                       what="the waiter waiting, its subscription confirmed")
            gate.set()
            for thread in threads:
                thread.join(timeout=120)
        assert waiter.cache_stats.lease_waits == {"complete": 1}
        assert waiter.waits.woken >= 1, "the holder's announcements woke the waiter"
        assert answers["waiter"][2].usage.cached_prompt_tokens == PREFIX - 1, "all but the last token, as a warm request"
        assert answers["waiter"][0] == answers["holder"][0] == alone(waiter, request(ids, n=8))[0]
    finally:
        gate.set()
        holder.close()
        waiter.close()
