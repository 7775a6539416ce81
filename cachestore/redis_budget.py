"""redis-py connections and pools whose every socket wait is within the thread's ``StallBudget``.

``cachestore.budget`` says what a budget bounds; this is where a Redis call's waits meet it. A
call waits in four places, each given ``budget.wait_s(its timeout)`` and charged that when it
times out: a pooled connection to come free (``BlockingConnectionPool``'s queue), a connection
to open (TCP connect, and a TLS handshake: one wait, charged the larger of the connect and op
timeouts), a command to be sent, and each reply (a handshake's ``HELLO`` included). redis-py's
retries (the client's one retry, ``connect``'s) are made of these waits, so they need nothing of
their own: a retry after the budget is spent fails at once, without touching the socket. A reply
due on a connection that will not be read drops the connection (out of step).

Without an active budget every wait gets its configured timeout, as plain redis-py gives it. Only
redis-py's public API is used (documented constructor arguments, public methods and properties
overridden in subclasses), so that a redis-py release that keeps its API keeps these bounds.
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
    """Charges a wait that timed out, once: a wait inside another (a handshake's reply inside a
    connect) was charged where it timed out, and the same exception passing through the outer one
    is not charged again. A wait the budget refused to start waited nothing."""
    if waited_s is None or isinstance(exc, StoreBudgetSpent) or getattr(exc, "_kvshare_charged", False):
        return
    budget.charge(waited_s)
    try:
        exc._kvshare_charged = True
    except AttributeError:  # an exception without a __dict__: charged here, and nowhere else it passes
        pass


_NONE = object()


def _capped(configured_s: float | None) -> float | None:
    return budget.capped_s(configured_s) if configured_s is not None else configured_s


class _Budgeted:
    """Mixin before a redis-py connection class (``budgeted``), on redis-py's public API alone: it
    overrides the ``socket_timeout`` and ``socket_connect_timeout`` properties and the
    ``connect_check_health``, ``send_packed_command`` and ``read_response`` methods, and gives a
    connected socket its next wait's timeout with ``update_current_socket_timeout`` (one system
    call a wait). The configured timeouts stay where redis-py keeps them, read through the base
    class's properties."""

    @property
    def socket_timeout(self) -> float | None:
        """The configured op timeout within the thread's budgets: what redis-py gives a socket it
        opens (and a TLS handshake on it); every wait below sets its own anyway."""
        return _capped(super().socket_timeout)

    @socket_timeout.setter
    def socket_timeout(self, value: float | None) -> None:
        super(_Budgeted, type(self)).socket_timeout.__set__(self, value)

    @property
    def socket_connect_timeout(self) -> float | None:
        """The configured connect timeout within the thread's budgets: the TCP connect's wait."""
        return _capped(super().socket_connect_timeout)

    @socket_connect_timeout.setter
    def socket_connect_timeout(self, value: float | None) -> None:
        super(_Budgeted, type(self)).socket_connect_timeout.__set__(self, value)

    def _op_wait_s(self) -> float | None:
        """What the wait about to start may take: the op timeout within the budgets."""
        return _wait_s(super().socket_timeout)

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        """Opens the connection if it is closed, in one attempt: the TCP connect and a TLS
        handshake, one wait charged the larger of the connect and op timeouts (within the budget,
        through the properties above), then the handshake's commands, budgeted where they are
        sent and read. Never redis-py's retry of the socket connect inside it: each retry is the
        caller's (the client's one retry of a command, ``connect``'s), an attempt of its own that
        meets the budget again."""
        if self.is_connected:
            return
        connect_s = _wait_s(super().socket_connect_timeout)
        op_s = self._op_wait_s()
        try:
            super().connect_check_health(check_health, retry_socket_connect=False)
        except redis.TimeoutError as exc:  # the connect or the handshake (redis-py's "Timeout connecting")
            waits = [s for s in (connect_s, op_s if isinstance(self, SSLConnection) else None) if s is not None]
            _charge(exc, max(waits) if waits else None)
            raise

    def send_packed_command(self, command, check_health=True):
        if not self.is_connected:
            self.connect_check_health(check_health=False)  # its own waits, budgeted where they are
        timeout = self._op_wait_s()
        self.update_current_socket_timeout(timeout)
        try:
            return super().send_packed_command(command, check_health=check_health)
        except redis.TimeoutError as exc:
            _charge(exc, timeout)
            raise

    def read_response(self, *args, **kwargs):
        if kwargs.get("timeout", _NONE) is not _NONE:
            return super().read_response(*args, **kwargs)  # a poll with a timeout of its own (pub/sub)
        try:
            timeout = self._op_wait_s()
        except StoreBudgetSpent:
            self.disconnect()  # the reply asked for will not be read: the connection is out of step
            raise
        self.update_current_socket_timeout(timeout)
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
