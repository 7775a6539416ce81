"""Opens a store from one URL; the scheme picks the backend.

- ``memory://``: in-process LRU bounded in bytes (the embedded default; nothing is shared).
- ``redis://host:port/db``, ``rediss://`` (TLS), ``unix:///path/redis.sock``: one Redis server.
- ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS): Redis Cluster, any node as seed.
- ``tiered+<any of the Redis URLs>``: a memory L1 in each worker in front of that Redis L2.

TLS (``rediss://``) takes a CA file and optionally a client certificate and key (``RedisTLS``);
the password comes from ``StoreOptions.password`` (read by the caller from a file or the
environment) or from the URL; it is never logged. With a keyring, the shared tier is wrapped in a
``SignedStore`` below the L1, so the L1 only ever holds verified values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from cachestore.breaker import BreakerPolicy
from cachestore.lease_terms import LeaseTerms
from cachestore.memory import MemoryStore
from cachestore.redis_budget import (
    BudgetedBlockingConnectionPool,
    BudgetedConnectionPool,
)
from cachestore.redis_store import RedisStore
from cachestore.resilient import ResilientStore
from cachestore.signed import SignedStore
from cachestore.signing import Keyring
from cachestore.stats import CacheStats
from cachestore.store import KVStore
from cachestore.tiered import TieredStore


@dataclass(frozen=True, slots=True)
class RedisTLS:
    """Files for a ``rediss://`` connection; the server's certificate is always verified."""

    ca_file: Path | None = None
    """CA bundle that signed the server's certificate (None: the system's CAs)."""
    cert_file: Path | None = None
    """Client certificate, for servers with ``tls-auth-clients yes``."""
    key_file: Path | None = None


VALUE_HEADER_ROOM_BYTES = 4096
"""Bytes a stored value may hold beyond ``StoreOptions.max_value_bytes``: the codec's header and a
signing envelope (under 200 together), so that the largest value a worker stores is read back."""

REQUEST_OP_TIMEOUTS = 2
"""A request's calls to a store that does not answer wait this many op timeouts in all, at most
(``cachestore.budget``): one call and its one retry, or two calls, never more, whatever the store
does; then the request computes."""


@dataclass(frozen=True, slots=True)
class StoreOptions:
    ttl_s: int = 3600
    op_timeout_ms: float = 250.0
    """Bounds each socket wait of a store call; ``REQUEST_OP_TIMEOUTS`` of them bound a request's."""
    connect_timeout_ms: float = 100.0
    max_connections: int = 32
    max_value_bytes: int = 128 * 1024 * 1024
    """``--cache-max-value-bytes``: the largest tensor a value holds (cross K/V larger is not
    stored); no read of the shared tier transfers more than this (and ``VALUE_HEADER_ROOM_BYTES``)
    of any value, whatever is planted there. Each reader bounds its values tighter where it can:
    a prefix block to its exact size, a lease to ``store.MAX_LEASE_BYTES``."""
    memory_max_bytes: int = 512 * 1024 * 1024
    l1_max_bytes: int = 256 * 1024 * 1024
    breaker: BreakerPolicy = BreakerPolicy()
    tls: RedisTLS = RedisTLS()
    username: str = ""
    """Redis ACL user (empty: ``default``, or the URL's)."""
    password: str = field(default="", repr=False)
    """AUTH password (empty: the URL's, if any)."""
    keyring: Keyring | None = None
    """Signs values written to and verifies values read from the shared tier."""
    lease_terms: LeaseTerms = LeaseTerms()
    """How long a signed lease may live and how far apart clocks may be (``SignedStore``)."""


def url_holds_password(url: str) -> bool:
    """Whether a cache URL carries a password, in its user part or as redis-py's ?password=."""
    parts = urlsplit(url.removeprefix("tiered+"))
    return bool(parts.password) or any(key.lower() == "password" for key, _ in parse_qsl(parts.query, keep_blank_values=True))


class StoreURLError(ValueError):
    """The cache URL names no known backend."""


# redis-py query options that would connect to a Redis whose certificate is not checked: whoever can
# answer in its place could then serve K/V that decides the workers' answers.
_UNVERIFIED_TLS = {"ssl_cert_reqs": {"none", "optional", "cert_none", "cert_optional"},
                   "ssl_check_hostname": {"false", "0", "no", "off", "n", "f"}}


def _redis_connector(url: str, options: StoreOptions) -> tuple[Callable[[], redis.Redis | RedisCluster], str]:
    parts = urlsplit(url)
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if value.strip().lower() in _UNVERIFIED_TLS.get(key.lower(), ()):
            raise StoreURLError(f"the cache URL's ?{key}={value} would skip checking the Redis server's certificate: "
                                "kvshare always checks it; give a private CA with --cache-tls-ca-file instead")
    tls = options.tls
    if (tls.ca_file or tls.cert_file or tls.key_file) and not parts.scheme.startswith("rediss"):
        raise StoreURLError(f"cache TLS files are set but the cache URL is {parts.scheme}://: use rediss:// "
                            "(or rediss+cluster://) to connect over TLS")
    if bool(tls.cert_file) != bool(tls.key_file):
        raise StoreURLError("a Redis client certificate needs both its certificate file and its key file")
    # Options in the URL's query (?ssl_ca_certs=...) take precedence over these, as in redis-py.
    given = {"username": options.username, "password": options.password, "ssl_ca_certs": tls.ca_file,
             "ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    common = dict(
        **{k: str(v) for k, v in given.items() if v},
        socket_timeout=options.op_timeout_ms / 1e3,
        socket_connect_timeout=options.connect_timeout_ms / 1e3,
        # One retry absorbs a pooled connection that went stale (e.g. Redis restarted); more
        # would only hold a request up while the store is down (and the request's budget ends
        # any retry: ``cachestore.redis_budget``).
        retry=Retry(NoBackoff(), 1),
    )
    if parts.scheme in ("redis+cluster", "rediss+cluster"):
        plain = urlunsplit((parts.scheme.split("+")[0], parts.netloc, parts.path, parts.query, ""))
        return (lambda: RedisCluster.from_url(plain, max_connections=options.max_connections,
                                              connection_pool_class=BudgetedConnectionPool, **common)), "redis-cluster"

    def connect() -> redis.Redis:
        pool = BudgetedBlockingConnectionPool.from_url(
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
    request_wait_s = REQUEST_OP_TIMEOUTS * options.op_timeout_ms / 1e3
    redis_store = RedisStore(connect, options.ttl_s, name, request_wait_s,
                             max_value_bytes=options.max_value_bytes + VALUE_HEADER_ROOM_BYTES, stats=stats)
    shared: KVStore = ResilientStore(redis_store, stats, options.breaker)
    if options.keyring is not None:
        shared = SignedStore(shared, options.keyring, stats, options.lease_terms)
    return TieredStore(MemoryStore(options.l1_max_bytes), shared) if tiered else shared
