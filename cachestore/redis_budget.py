"""redis-py connections and pools whose every socket wait is within the thread's ``StallBudget``.

``cachestore.budget`` says what a budget bounds; this is where a Redis call's waits meet it. A
call waits in four places, each given ``budget.wait_s(its timeout)`` and charged that when it
times out: a pooled connection to come free (``BlockingConnectionPool``'s queue), a connection
to open (TCP connect, and a TLS handshake: one wait, charged the larger of the connect and op
timeouts), a command to be sent, and each reply (a handshake's ``HELLO`` included). redis-py's
retries (the client's one retry, the reconnect's own) are made of these waits, so they need
nothing of their own: a retry after the budget is spent fails at once, without touching the
socket. A reply due on a connection that will not be read drops the connection (out of step).

Without an active budget every wait gets its configured timeout, as plain redis-py gives it.
"""

from __future__ import annotations

import functools
import math
from queue import Empty, LifoQueue

import redis
from redis.connection import SSLConnection

from cachestore import budget


class StoreBudgetSpent(redis.TimeoutError):
    """A wait of a Redis call was about to start on a thread whose budget is spent: a timeout to
    redis-py (its retry gives up at once: the next attempt finds the budget spent too)."""


def _wait_s(timeout_s: float | None) -> float | None:
    """``budget.wait_s`` for a configured timeout that may be None (no timeout: within a budget,
    what it has left); raises ``StoreBudgetSpent`` instead of ``budget.BudgetSpent``."""
    if timeout_s is None and not budget.active():
        return None
    try:
        return budget.wait_s(math.inf if timeout_s is None else timeout_s)
    except budget.BudgetSpent as exc:
        raise StoreBudgetSpent(str(exc)) from None


def _charge(exc: BaseException, waited_s: float | None) -> None:
    """Charges a wait that timed out, once: a wait inside another (a reconnect's handshake inside a
    send) was charged where it timed out, and the same exception passing through the outer one
    is not charged again."""
    if waited_s is not None and not getattr(exc, "_kvshare_charged", False):
        budget.charge(waited_s)
        try:
            exc._kvshare_charged = True
        except AttributeError:  # an exception without a __dict__: charged here, and nowhere else it passes
            pass


_NONE = object()


def _set_timeout(sock, timeout_s: float | None) -> None:
    """Gives the socket's next waits ``timeout_s`` (a system call only when it changes: a fetch
    reads a reply per block)."""
    if sock.gettimeout() != timeout_s:
        sock.settimeout(timeout_s)


def _capped_timeout(attribute: str) -> property:
    """A timeout setting that reads as the configured one (kept in ``attribute``) within the
    thread's budgets: what redis-py itself sets a socket to (after connecting, after a poll) stays
    within them; every wait below sets its own timeout anyway."""

    def get(self):
        configured = getattr(self, attribute)
        return budget.capped_s(configured) if configured is not None else configured

    def set(self, value) -> None:
        setattr(self, attribute, value)

    return property(get, set)


class _Budgeted:
    """Mixin before a redis-py connection class (``budgeted``)."""

    socket_timeout = _capped_timeout("_socket_timeout")
    socket_connect_timeout = _capped_timeout("_socket_connect_timeout")

    def _connect(self):
        connect_s = _wait_s(self._socket_connect_timeout)
        op_s = _wait_s(self._socket_timeout)
        try:
            return super()._connect()  # reads the capped ``socket_connect_timeout`` and ``socket_timeout``
        except TimeoutError as exc:  # socket.timeout: the TCP connect or a TLS handshake's read
            waits = [s for s in (connect_s, op_s if isinstance(self, SSLConnection) else None) if s is not None]
            _charge(exc, max(waits) if waits else None)
            raise

    def send_packed_command(self, command, check_health=True):
        if not self._sock:
            self.connect_check_health(check_health=False)  # its own waits, budgeted where they are
        timeout = _wait_s(self._socket_timeout)
        _set_timeout(self._sock, timeout)
        try:
            return super().send_packed_command(command, check_health=check_health)
        except redis.TimeoutError as exc:
            _charge(exc, timeout)
            raise

    def read_response(self, *args, **kwargs):
        if kwargs.get("timeout", _NONE) is not _NONE:
            return super().read_response(*args, **kwargs)  # a poll with a timeout of its own (pub/sub)
        try:
            timeout = _wait_s(self._socket_timeout)
        except StoreBudgetSpent:
            self.disconnect()  # the reply asked for will not be read: the connection is out of step
            raise
        if self._sock is not None:
            _set_timeout(self._sock, timeout)
        try:
            return super().read_response(*args, **kwargs)
        except redis.TimeoutError as exc:
            _charge(exc, timeout)
            raise


@functools.cache
def budgeted(connection_class: type) -> type:
    """``connection_class`` (TCP, TLS or Unix socket) with every wait within the thread's budget."""
    if issubclass(connection_class, _Budgeted):
        return connection_class
    return type(f"Budgeted{connection_class.__name__}", (_Budgeted, connection_class), {})


class _BudgetedQueue(LifoQueue):
    """The pool's free connections: waiting for one to come free is a wait like the others."""

    def get(self, block: bool = True, timeout: float | None = None):
        if not block:
            return super().get(block, timeout)
        wait = _wait_s(timeout)
        try:
            return super().get(block, wait)
        except Empty as exc:
            _charge(exc, wait)
            raise


class BudgetedBlockingConnectionPool(redis.BlockingConnectionPool):
    """A single server's pool (``from_url`` picks the connection class from the URL's scheme)."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs) -> None:
        kwargs["queue_class"] = _BudgetedQueue
        super().__init__(connection_class=budgeted(connection_class), **kwargs)


class BudgetedConnectionPool(redis.ConnectionPool):
    """A cluster node's pool (``RedisCluster``'s ``connection_pool_class``)."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs) -> None:
        super().__init__(connection_class=budgeted(connection_class), **kwargs)
