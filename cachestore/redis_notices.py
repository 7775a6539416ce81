"""Announcements through Redis pub/sub: the channel of a key is the key itself.

One connection per worker, held only while it listens to something, subscribed to the keys its
waiting requests wait on; a thread of its own reads it. A waiter then looks for blocks when the
holder announces a chunk instead of many times in between: on machines the replicas share, each
of those looks takes CPU the holder is computing with (three waiters looking every 10 ms made
the holder's prefill 11% slower).

What Redis sends here is a hint, never data: a forged or lost announcement costs a look too many
or a look later, and a flood of them (more than ``MAX_PER_S``) is dropped with the connection,
as is any failure; the listener is then not ``live`` and its waiters poll until it is again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

import redis
from redis.cluster import RedisCluster

from cachestore.ratelimit import RateLimitedLog
from cachestore.store import Notices

log = logging.getLogger(__name__)
_failing = RateLimitedLog(log)

TICK_S = 0.05
"""Longest a read waits before the thread subscribes to keys given meanwhile (s)."""
RETRY_S = 1.0
"""Pause after a failure before subscribing again (s)."""
MAX_PER_S = 1000
"""More messages than this in a second is a server out of step or hostile, not workers announcing
chunks (a holder announces each of its lease keys once per chunk)."""


class RedisNotices(Notices):
    def __init__(self, client: Callable[[], redis.Redis | RedisCluster], on_notice: Callable[[str], None],
                 name: str) -> None:
        self._client = client
        self._on_notice = on_notice
        self._name = name
        self._wanted: frozenset[str] = frozenset()
        self._confirmed: set[str] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-notices", daemon=True)
        self._thread.start()

    def listen(self, keys: Collection[str]) -> None:
        with self._cond:
            self._wanted = frozenset(keys)
            self._cond.notify()

    @property
    def live(self) -> bool:
        with self._cond:
            return self._wanted <= self._confirmed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        pubsub: redis.client.PubSub | None = None
        sent: set[str] = set()
        """Channels subscribed to on the current connection and not unsubscribed since."""
        window, count = time.monotonic(), 0
        while True:
            with self._cond:
                while not self._closed and not self._wanted and not sent:
                    if pubsub is not None:  # nothing to listen to: the connection goes back
                        pubsub.close()
                        pubsub = None
                    self._cond.wait()
                if self._closed:
                    break
                wanted = self._wanted
            try:
                if pubsub is None:
                    pubsub = self._client().pubsub()
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
                if now - window >= 1.0:
                    window, count = now, 0
                count += message is not None
                if count > MAX_PER_S:
                    raise redis.ConnectionError(f"more than {MAX_PER_S} messages a second")
                if message is not None:
                    self._handle(message, sent)
            except Exception as exc:  # noqa: BLE001 - announcements are a hint; waiters poll without them
                _failing.warning("cache store %s: announcements unavailable (%s: %s); waiting workers poll instead",
                                 self._name, type(exc).__name__, exc)
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001 - the connection is dropped either way
                        pass
                pubsub, sent = None, set()
                with self._cond:
                    self._confirmed.clear()
                    if not self._closed:
                        self._cond.wait(RETRY_S)
        if pubsub is not None:
            pubsub.close()

    def _handle(self, message: dict, sent: set[str]) -> None:
        kind, channel = message.get("type"), message.get("channel")
        if isinstance(kind, bytes):
            kind = kind.decode("ascii", "replace")
        if not isinstance(channel, bytes | str):
            return
        key = channel.decode("utf-8", "replace") if isinstance(channel, bytes) else channel
        if key not in sent:
            return
        if kind == "subscribe":
            with self._cond:
                self._confirmed.add(key)
        elif kind != "message":
            return
        # On a confirmed subscription too: what was announced before it took effect was missed,
        # so the listener looks once now.
        self._on_notice(key)
