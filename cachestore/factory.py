"""Opens a store from one URL; the scheme picks the backend.

- ``memory://``: in-process LRU bounded in bytes (the embedded default; nothing is shared).
- ``redis://host:port/db``, ``rediss://`` (TLS), ``unix:///path/redis.sock``: one Redis server.
- ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS): Redis Cluster, any node as seed.
- ``tiered+<any of the Redis URLs>``: a memory L1 in each worker in front of that Redis L2.

Passwords go in the URL (``redis://:secret@host:6379``) or in ``REDISCLI_AUTH``-style secrets
mounted by the deployment; they are never logged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from cachestore.breaker import BreakerPolicy
from cachestore.memory import MemoryStore
from cachestore.redis_store import RedisStore
from cachestore.resilient import ResilientStore
from cachestore.stats import CacheStats
from cachestore.store import KVStore
from cachestore.tiered import TieredStore


@dataclass(frozen=True, slots=True)
class StoreOptions:
    ttl_s: int = 3600
    op_timeout_ms: float = 250.0
    connect_timeout_ms: float = 100.0
    max_connections: int = 32
    memory_max_bytes: int = 512 * 1024 * 1024
    l1_max_bytes: int = 256 * 1024 * 1024
    breaker: BreakerPolicy = BreakerPolicy()


class StoreURLError(ValueError):
    """The cache URL names no known backend."""


def _redis_connector(url: str, options: StoreOptions) -> tuple[Callable[[], redis.Redis | RedisCluster], str]:
    parts = urlsplit(url)
    common = dict(
        socket_timeout=options.op_timeout_ms / 1e3,
        socket_connect_timeout=options.connect_timeout_ms / 1e3,
        # One retry absorbs a pooled connection that went stale (e.g. Redis restarted); more
        # would only hold a request up while the store is down.
        retry=Retry(NoBackoff(), 1),
    )
    if parts.scheme in ("redis+cluster", "rediss+cluster"):
        plain = urlunsplit((parts.scheme.split("+")[0], parts.netloc, parts.path, parts.query, ""))
        return (lambda: RedisCluster.from_url(plain, max_connections=options.max_connections, **common)), "redis-cluster"

    def connect() -> redis.Redis:
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=options.max_connections, timeout=options.op_timeout_ms / 1e3, **common
        )
        return redis.Redis(connection_pool=pool)

    return connect, "redis"


def open_store(url: str, options: StoreOptions, stats: CacheStats) -> KVStore:
    """The store for ``url``; failures of a shared tier are absorbed by a ResilientStore."""
    if "://" not in url:
        raise StoreURLError(f"cache URL {url!r} has no scheme: use memory://, redis://HOST:PORT[/DB], "
                            "rediss://…, unix:///PATH, redis+cluster://HOST:PORT or tiered+ before a Redis URL")
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return MemoryStore(options.memory_max_bytes)
    tiered = scheme.startswith("tiered+")
    if tiered:
        url, scheme = url[len("tiered+"):], scheme[len("tiered+"):]
        if scheme == "memory":
            raise StoreURLError("tiered+ goes before a Redis URL (tiered+redis://HOST:PORT); memory:// alone is "
                                "already a worker-local cache")
    if scheme in ("redis+cluster", "rediss+cluster") and not urlsplit(url).hostname:
        raise StoreURLError(f"cache URL {url!r} names no seed node: use {scheme}://HOST:PORT")
    if scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        raise StoreURLError(
            f"cache URL scheme {scheme!r} is not one of memory://, redis://, rediss://, unix://, redis+cluster://, "
            "rediss+cluster:// (a Redis one optionally prefixed with tiered+)"
        )
    connect, name = _redis_connector(url, options)
    shared = ResilientStore(RedisStore(connect, options.ttl_s, name), stats, options.breaker)
    return TieredStore(MemoryStore(options.l1_max_bytes), shared) if tiered else shared
