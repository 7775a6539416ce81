"""Redis (single server or Redis Cluster) as the shared tier, through redis-py with hiredis.

One value per key, written with ``SET key value NX EX ttl`` (one atomic command: a reader never
sees half a block), pipelined without MULTI. Reads are one pipeline of ``GETRANGE key 0 bound``
(split per node on a cluster), one round trip as with ``GET``, where ``bound`` is the longest value
its reader accepts (``KVStore``'s ``limit``, within ``max_value_bytes``): Redis answers at most
``bound + 1`` bytes (the offsets are inclusive), so a longer value, which whoever can write to
Redis may plant under any key, is known oversized after that many bytes and never transferred
whole. ``GETRANGE`` answers an empty string for a missing key where ``GET`` answers nil: values
are never empty, so both are a miss (and an empty value is replaced by the next write). Socket
and connect timeouts bound every operation (milliseconds in the options).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence

import redis
from redis.cluster import RedisCluster

from cachestore.budget import StallBudget
from cachestore.codec import RejectReason
from cachestore.ratelimit import RateLimitedLog
from cachestore.redis_notices import RedisNotices
from cachestore.stats import CacheStats
from cachestore.store import MAX_LEASE_BYTES, KVStore, Notices, StoreReplyError

log = logging.getLogger(__name__)
_foreign = RateLimitedLog(log)
_oversized = RateLimitedLog(log)


def _values(reply: object, count: int) -> list[bytes | None]:
    """``reply`` if it is ``count`` values or nils, else StoreReplyError: whatever answers on the
    Redis port, nothing but bytes or None leaves this class."""
    if not isinstance(reply, list) or len(reply) != count:
        raise StoreReplyError(f"expected {count} values, got {type(reply).__name__}"
                              + (f" of {len(reply)}" if isinstance(reply, list) else ""))
    for value in reply:
        if value is not None and not isinstance(value, bytes):
            raise StoreReplyError(f"expected a value or nil, got {type(value).__name__}")
    return reply


def _more_to_read(connection: redis.connection.AbstractConnection) -> bool:
    """Whether bytes wait on ``connection`` after the replies asked for: the server is out of step.
    A connection the server closed after its last reply holds nothing more; it is dropped here,
    and the replies already read stand."""
    try:
        return connection.can_read(timeout=0)
    except (redis.ConnectionError, OSError):
        connection.disconnect()
        return False


_IF_HELD = """
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] == '0' then
    return redis.call('DEL', KEYS[1])
  end
  if ARGV[3] then
    redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
    return 1
  end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
"""A lease's compare-and-delete (ARGV[2] 0) or compare-and-renew (ARGV[2] ms; with ARGV[3], the
value it holds from now on), atomic on the server; 1 when done, else 0."""


def _wrong_type(reply: object) -> bool:
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")

# First match wins: authentication errors are connection errors to redis-py, OOM a response error.
_ERROR_KINDS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("timeout", redis.TimeoutError),
    ("auth", (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.NoPermissionError)),
    ("connection", redis.ConnectionError),
    ("out_of_memory", redis.exceptions.OutOfMemoryError),
    ("response", redis.ResponseError),
    ("protocol", (StoreReplyError, redis.exceptions.InvalidResponse)),
)


def _caused_by(exc: BaseException, kind: type) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RedisStore(KVStore):
    """``connect`` makes the client on first use, and again after it failed, so that a worker
    starts and serves while Redis (or the cluster's seed node) is still unreachable."""

    def __init__(self, connect: Callable[[], redis.Redis | RedisCluster], ttl_s: int, name: str = "redis",
                 request_wait_s: float = 0.0, *, max_value_bytes: int, stats: CacheStats) -> None:
        """``request_wait_s``: what one request's calls may wait in all on a server that does not
        answer (``stall_budget``; 0: no bound but each wait's timeout). Budgets bind only
        connections from ``cachestore.redis_budget``'s pools, which ``factory`` gives ``connect``.
        ``max_value_bytes``: no read transfers more than this many bytes (and one) of a value,
        whatever its reader's own limit; ``stats`` counts the values deleted for being longer."""
        self._connect = connect
        self.request_wait_s = request_wait_s
        self.max_value_bytes = max_value_bytes
        self.stats = stats
        self._client_or_none: redis.Redis | RedisCluster | None = None
        self._lock = threading.Lock()
        self.ttl_s = ttl_s
        self.name = name
        self._lease_script = None

    @property
    def _client(self) -> redis.Redis | RedisCluster:
        if self._client_or_none is None:
            with self._lock:
                if self._client_or_none is None:
                    self._client_or_none = self._connect()
        return self._client_or_none

    @property
    def _cluster(self) -> bool:
        return isinstance(self._client, RedisCluster)

    def stall_budget(self) -> StallBudget | None:
        return StallBudget(self.request_wait_s) if self.request_wait_s > 0 else None

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        return self.get_many([key], None if limit is None else [limit])[0]

    def get_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> list[bytes | None]:
        """A single server streams (``iter_many``); a cluster pipelines the reads to each key's node."""
        if not keys:
            return []
        if not self._cluster:
            return list(self.iter_many(keys, limits))
        bounds = self._bounds(keys, limits)
        pipe = self._client.pipeline(transaction=False)
        for key, bound in zip(keys, bounds, strict=True):
            pipe.getrange(key, 0, bound)
        replies = [None if _wrong_type(reply) else reply for reply in pipe.execute(raise_on_error=False)]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        oversized: list[str] = []
        values = [self._checked(key, reply, bound, oversized)
                  for key, reply, bound in zip(keys, _values(replies, len(keys)), bounds, strict=True)]
        self._distrust(oversized)
        return values

    def iter_many(self, keys: Sequence[str], limits: Sequence[int] | None = None) -> Iterator[bytes | None]:
        """One pipeline of ``GETRANGE``s on one pooled connection, each reply yielded as it is parsed.

        Why not ``MGET``: its reply holds every value at once, so a 16 MiB prefix is 16 MiB of
        fresh allocations, and the page faults of that memory cost as much as the transfer;
        values used and dropped one by one reuse the same memory. A caller that stops early
        leaves replies unread on the connection: they are read (each bounded too) and dropped
        before it goes back to the pool. Values longer than their bound are deleted once the
        connection is back. A cluster reads through ``get_many``."""
        if self._cluster or not keys:
            yield from self.get_many(keys, limits)
            return
        oversized: list[str] = []
        try:
            yield from self._stream(keys, self._bounds(keys, limits), oversized)
        finally:
            self._distrust(oversized)

    def _stream(self, keys: Sequence[str], bounds: Sequence[int], oversized: list[str]) -> Iterator[bytes | None]:
        pool = self._client.connection_pool
        connection = pool.get_connection()
        packed = connection.pack_commands([("GETRANGE", key, 0, bound) for key, bound in zip(keys, bounds, strict=True)])

        def reply() -> object:
            try:
                return connection.read_response()
            except redis.ResponseError as exc:
                if _wrong_type(exc):
                    return None  # a key holding a list or hash: a miss (put_many replaces it)
                raise

        def first_reply() -> object:
            connection.send_packed_command(packed)
            return reply()

        unread, clean = len(keys), False
        try:
            # The client's one retry, as for any command: a pooled connection that went stale
            # fails on its first reply, before anything was yielded.
            value = connection.retry.call_with_retry(first_reply, lambda _error: connection.disconnect())
            while True:
                i = len(keys) - unread
                unread -= 1
                yield self._checked(keys[i], value, bounds[i], oversized)
                if not unread:
                    break
                value = reply()
            clean = not _more_to_read(connection)
        except GeneratorExit:
            while unread:
                i = len(keys) - unread
                self._checked(keys[i], reply(), bounds[i], oversized)
                unread -= 1
            clean = not _more_to_read(connection)
            if clean:
                raise
        finally:
            if not clean:  # a failure mid-reply, or more replies than GETs: the connection is out of step
                connection.disconnect()
            pool.release(connection)
        if not clean:
            raise StoreReplyError(f"the server sent more than the {len(keys)} replies asked for")

    def _bounds(self, keys: Sequence[str], limits: Sequence[int] | None) -> list[int]:
        """Each key's longest acceptable value in bytes: its reader's limit within ``max_value_bytes``."""
        if limits is None:
            return [self.max_value_bytes] * len(keys)
        return [min(self.max_value_bytes, limit) for limit in limits]

    @staticmethod
    def _checked(key: str, reply: object, bound: int, oversized: list[str]) -> bytes | None:
        """The value in a ``GETRANGE key 0 bound`` reply, or None: for a missing key (an empty
        answer), and for a value longer than ``bound`` (a reply of ``bound + 1`` bytes), whose key
        goes to ``oversized``."""
        value = _values([reply], 1)[0]
        if not value:
            return None
        if len(value) > bound:
            oversized.append(key)
            return None
        return value

    def _distrust(self, keys: Sequence[str]) -> None:
        """Deletes values found longer than their readers' bounds: written by someone else (no
        worker writes one), they are counted and deleted as values that fail verification are,
        so that the next publish (set-if-absent) writes the real one in their place."""
        if not keys:
            return
        self.stats.count("rejected_values", RejectReason.OVERSIZED, len(keys))
        _oversized.warning("cache store %s: %d values longer than their readers accept (e.g. %s); deleted, computing "
                           "instead", self.name, len(keys), keys[0])
        self.delete(keys)

    def put(self, key: str, value: bytes) -> bool:
        """As ``put_many``: a key someone filled with a non-value is replaced (a cross K/V's too)."""
        return self.put_many([(key, value)]) > 0

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        if not items:
            return 0
        written = self._set_if_absent(items)
        refused = [item for item, ok in zip(items, written, strict=True) if not ok]
        if refused:
            # A key that a read found missing and SET NX cannot fill holds a list, a hash... or an
            # empty string: written by someone else, it would make that block a miss forever. Off
            # the token path, so the extra round trip (only when a write was refused) costs no
            # request anything. One byte of each tells (a key gone meanwhile is written too).
            pipe = self._client.pipeline(transaction=False)
            for key, _ in refused:
                pipe.getrange(key, 0, 0)
            replies = pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, Exception) and not _wrong_type(reply):
                    raise reply
            foreign = [item for item, reply in zip(refused, replies, strict=True) if _wrong_type(reply) or reply == b""]
            if foreign:
                _foreign.warning("cache store %s: %d keys held a non-string or empty value (e.g. %s); replaced",
                                 self.name, len(foreign), foreign[0][0])
                self.delete([key for key, _ in foreign])
                written += self._set_if_absent(foreign)
        return sum(bool(ok) for ok in written)

    def _set_if_absent(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, nx=True, ex=self.ttl_s)
        return [bool(ok) for ok in pipe.execute()]

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self._client.delete(*keys)

    def claim(self, key: str, token: bytes, ttl_ms: int) -> bytes | None:
        """``SET key token NX PX ttl`` and ``GETRANGE key 0 MAX_LEASE_BYTES`` in one round trip (any
        Redis version: no ``SET … GET``); the second names whoever holds the lease now, read no
        further than a lease can be long. A key holding a list, a hash, an empty string or a value
        longer than any lease (written by someone else) is replaced, as ``put_many`` replaces block
        keys: it would otherwise stand in for a lease nobody holds, forever."""
        for _ in range(2):
            pipe = self._client.pipeline(transaction=False)
            pipe.set(key, token, nx=True, px=max(1, ttl_ms))
            pipe.getrange(key, 0, MAX_LEASE_BYTES)
            replies = pipe.execute(raise_on_error=False)
            held = replies[1]
            if isinstance(held, bytes) and len(held) > MAX_LEASE_BYTES:
                self._distrust([key])
            elif any(_wrong_type(reply) for reply in replies) or held == b"":
                _foreign.warning("cache store %s: lease key %s held a non-string or empty value; replaced", self.name, key)
                self.delete([key])
            else:
                break
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return self._checked(key, replies[1], MAX_LEASE_BYTES, [])

    def holder(self, key: str) -> bytes | None:
        """A key of another type reads as nobody; a value longer than any lease is deleted."""
        return self.get(key, MAX_LEASE_BYTES)

    def release(self, key: str, token: bytes) -> None:
        """Deletes the lease only while ``token`` holds it: a compare-and-delete, atomic on the
        server (a script), so a lease that expired and was taken by another worker survives."""
        self._if_held(key, token, 0)

    def renew(self, key: str, token: bytes, ttl_ms: int, replacement: bytes | None = None) -> bool:
        """Sets the lease to expire ``ttl_ms`` from now, holding ``replacement`` if given, only
        while ``token`` holds it."""
        return self._if_held(key, token, max(1, ttl_ms), replacement)

    def _if_held(self, key: str, token: bytes, ttl_ms: int, replacement: bytes | None = None) -> bool:
        if self._lease_script is None:
            self._lease_script = self._client.register_script(_IF_HELD)
        args = [token, ttl_ms] if replacement is None else [token, ttl_ms, replacement]
        return self._lease_script(keys=[key], args=args) == 1

    def announce(self, channels: Sequence[str]) -> None:
        """``PUBLISH`` on each channel: pipelined on one server; on a cluster one at a time (its
        pipelines refuse it), each to the node of the channel's slot, which relays it to every other."""
        if not channels:
            return
        if self._cluster:
            for channel in channels:
                self._client.publish(channel, b"")
            return
        pipe = self._client.pipeline(transaction=False)
        for channel in channels:
            pipe.publish(channel, b"")
        pipe.execute()

    def notices(self, on_notice: Callable[[str, bool], None]) -> Notices:
        return RedisNotices(self._connect, on_notice, self.name)

    def error_kind(self, exc: Exception) -> str:
        if isinstance(exc, redis.ConnectionError) and _caused_by(exc, ssl.SSLError):
            return "tls"  # a failed handshake (unknown CA, bad client certificate) is a connection error to redis-py
        for kind, types in _ERROR_KINDS:
            if isinstance(exc, types):
                return kind
        return "error"

    def ping(self, connections: int = 1) -> None:
        if connections <= 1 or self._cluster:
            self._client.ping()
            return
        pool = self._client.connection_pool
        opened = []
        try:
            for _ in range(min(connections, pool.max_connections)):
                opened.append(pool.get_connection())
            for connection in opened:
                connection.send_command("PING")
            for connection in opened:
                connection.read_response()
        except BaseException:
            for connection in opened:
                connection.disconnect()
            raise
        finally:
            for connection in opened:
                pool.release(connection)

    def close(self) -> None:
        if self._client_or_none is not None:
            self._client_or_none.close()
