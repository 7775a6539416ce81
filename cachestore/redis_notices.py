"""Announcements through Redis pub/sub (``KVStore.announce`` / ``KVStore.notices``).

What Redis sends here is a hint, never data: a forged or lost announcement costs a look too many
or a look later, and a flood of them (more than ``MAX_PER_S``, or any that carries a payload) is
dropped with the connection, as is any failure and a connection that stops answering pings; the
subscription is then not ``live`` and its listeners poll until it is again, after a pause that
grows while failures go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

import redis
from redis.cluster import RedisCluster

from cachestore.ratelimit import RateLimitedLog
from cachestore.store import Notices, StoreReplyError

log = logging.getLogger(__name__)
_failing = RateLimitedLog(log)

TICK_S = 0.05
"""Longest a read waits before the thread subscribes to channels given meanwhile (s); until
then those channels are not live, and their listeners poll."""
RETRY_S, MAX_RETRY_S = 1.0, 30.0
"""Pause after a failure before subscribing again, doubling while failures go on (s): an ACL that
refuses the channels is not asked every second forever, nor a flood read once a second."""
STABLE_S = 60.0
"""A connection that lasted this long before failing starts the pauses over from ``RETRY_S`` (s)."""
CLOSE_S = 2.0
"""Longest ``close`` waits for the thread (s)."""
PING_S = 5.0
"""A subscribed connection silent this long is pinged; one whose ping is not answered within as
long again is dropped (a half-open connection delivers nothing and fails no read)."""
MAX_PER_S = 1000
"""More messages than this in a second is a server out of step or hostile, not workers announcing
chunks (a holder announces once per chunk)."""


class RedisNotices(Notices):
    """A subscription on a connection of its own (a client made by ``connect``, not the store's
    pool, so that it never takes a connection reads and writes need), opened while there are
    channels to listen to and closed when there are none; one thread reads it and calls
    ``on_notice(channel, announced)``: ``announced`` True for an announcement, False when the
    subscription to ``channel`` was confirmed or lost (look once: what was announced meanwhile
    was missed)."""

    def __init__(self, connect: Callable[[], redis.Redis | RedisCluster], on_notice: Callable[[str, bool], None],
                 name: str) -> None:
        self._connect = connect
        self._on_notice = on_notice
        self._name = name
        self._wanted: frozenset[str] = frozenset()
        self._confirmed: set[str] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-notices", daemon=True)
        self._thread.start()

    def listen(self, channels: Collection[str]) -> None:
        with self._cond:
            self._wanted = frozenset(channels)
            self._cond.notify()

    @property
    def live(self) -> bool:
        with self._cond:
            return self._wanted <= self._confirmed

    def close(self) -> None:
        """Stops the thread, waiting for it at most ``CLOSE_S``: a read that a server trickles
        byte by byte is not bounded by the socket's timeout, and must not hold up a worker's exit
        (the thread is a daemon, and calls nothing once closed)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(CLOSE_S)

    def _run(self) -> None:
        client: redis.Redis | RedisCluster | None = None
        pubsub = None
        sent: set[str] = set()  # subscribed on the current connection and not unsubscribed since
        retry_s, retry_at, connected = RETRY_S, 0.0, 0.0
        heard, pinged, window, count = 0.0, None, 0.0, 0  # last message, unanswered ping, flood window
        while True:
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    if now < retry_at:  # a pause after a failure: new channels do not cut it short
                        self._cond.wait(retry_at - now)
                    elif not self._wanted and not sent:
                        if client is not None:  # nothing to listen to: no connection held
                            _close(client, pubsub)
                            client = pubsub = None
                        self._cond.wait()
                    else:
                        break
                if self._closed:
                    break
                wanted = self._wanted
            try:
                if client is None:
                    client = self._connect()
                    pubsub = client.pubsub()
                    connected = heard = window = time.monotonic()
                    pinged, count = None, 0
                if gone := sent - wanted:
                    with self._cond:
                        self._confirmed -= gone
                    pubsub.unsubscribe(*gone)
                    sent -= gone
                if new := wanted - sent:
                    pubsub.subscribe(*new)
                    sent |= new
                message = pubsub.get_message(timeout=TICK_S) if sent else None
                now = time.monotonic()
                if message is not None:
                    heard, pinged = now, None
                    if now - window >= 1.0:
                        window, count = now, 0
                    count += 1
                    if count > MAX_PER_S:
                        raise redis.ConnectionError(f"more than {MAX_PER_S} messages in a second")
                    self._handle(message, sent)
                elif pinged is not None and now - pinged >= PING_S:
                    raise redis.TimeoutError(f"no answer to a ping in {PING_S:g} s")
                elif pinged is None and sent and now - heard >= PING_S:
                    pubsub.ping()
                    pinged = now
            except Exception as exc:  # noqa: BLE001 - announcements are a hint; listeners poll without them
                _failing.warning("cache store %s: announcements unavailable (%s: %s); waiting workers poll instead",
                                 self._name, type(exc).__name__, exc)
                _close(client, pubsub)
                client, pubsub = None, None
                lost, sent = sent, set()
                with self._cond:
                    self._confirmed.clear()
                for channel in lost:
                    self._notify(channel, False)
                now = time.monotonic()
                # A connection that held for a while failed once: soon again. Failures in a row
                # (a refusing ACL, a flood, a server down) wait longer each time.
                if connected and now - connected >= STABLE_S:
                    retry_s = RETRY_S
                retry_at, connected, retry_s = now + retry_s, 0.0, min(2 * retry_s, MAX_RETRY_S)
        _close(client, pubsub)

    def _notify(self, channel: str, announced: bool) -> None:
        with self._cond:
            if self._closed:
                return
        self._on_notice(channel, announced)

    def _handle(self, message: dict, sent: set[str]) -> None:
        """Passes a message on; raises on an announcement that carries something (workers announce
        nothing but the channel): a hostile writer's large messages cost one read, then a pause."""
        kind, channel = message.get("type"), message.get("channel")
        if not isinstance(channel, bytes | str):
            return
        channel = channel.decode("utf-8", "replace") if isinstance(channel, bytes) else channel
        if channel not in sent or kind not in ("subscribe", "message"):
            return
        if kind == "message" and message.get("data") not in (b"", ""):
            raise StoreReplyError("an announcement with a payload: not a worker's")
        if kind == "subscribe":
            with self._cond:
                self._confirmed.add(channel)
        self._notify(channel, kind == "message")


def _close(client: redis.Redis | RedisCluster | None, pubsub) -> None:
    for closable in (pubsub, client):
        if closable is not None:
            try:
                closable.close()
            except Exception:  # noqa: BLE001 - the connection is dropped either way
                pass
