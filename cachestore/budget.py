"""How long one request may wait, in all, on a store that does not answer.

Each socket wait of a store call (a connection opening, a send, a reply, a pooled connection to
come free) is bounded by the op (or connect) timeout. But one call may wait several times (the
client's one retry, with its reconnect's handshake), and one request makes several calls (the
lookup, the lease claim, the windowed layers, an encoder input's cross K/V): with a 250 ms op
timeout a request waited 1 s on a stopped Redis. A ``StallBudget`` bounds the sum.

While budgets are active on a thread (``spending``), every socket wait of a store call made there
is given at most what is left of each (``wait_s``); a wait that times out is charged what it was
given, to each (``charge``); once one is spent, no store call made there reaches the network
(``spent``: ``ResilientStore`` skips the call, a wait about to start fails at once), and the
request computes. So the waits that time out within a budget add up to at most its ``seconds``,
whatever the store does.

Only waits that time out are charged: a wait that ends with bytes costs nothing, so a large fetch
that streams (gigabytes of K/V) is never cut short, and a store that trickles a byte per op
timeout is bounded per wait only (docs/security.md). No clock either: a budget changes only when
a wait times out, so what a request may still wait is the same on any machine, and a test reads
it. A budget is used by one thread at a time (a request's fetch, then the waits' thread).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

RESOLUTION_S = 1e-6
"""Less than this left is nothing left (float sums of the charges)."""


class BudgetSpent(Exception):
    """A store wait was about to start on a thread whose budget is spent."""


@dataclass(slots=True, eq=False)
class StallBudget:
    """What the timed-out socket waits of one request's store calls may add up to."""

    seconds: float
    charged: float = 0.0
    """Seconds charged so far: the timeouts of the waits that timed out."""
    timeouts: int = 0
    """Waits that timed out (each charged)."""

    @property
    def left(self) -> float:
        return max(0.0, self.seconds - self.charged)

    @property
    def spent(self) -> bool:
        return self.left < RESOLUTION_S


_active: ContextVar[tuple[StallBudget, ...]] = ContextVar("kvshare_stall_budgets", default=())


@contextmanager
def spending(budget: StallBudget | None) -> Iterator[None]:
    """Store calls made on this thread inside the block wait within ``budget`` too (and within
    any budget an enclosing block gave). None: no budget of its own."""
    if budget is None:
        yield
        return
    token = _active.set((*_active.get(), budget))
    try:
        yield
    finally:
        _active.reset(token)


def active() -> bool:
    """Whether a budget is active on this thread."""
    return bool(_active.get())


def spent() -> bool:
    """Whether a budget active on this thread is spent: a store call would not reach the store."""
    return any(budget.spent for budget in _active.get())


def wait_s(timeout_s: float) -> float:
    """The longest the socket wait about to start may take: ``timeout_s`` within what every active
    budget has left. Raises ``BudgetSpent`` when one has nothing left (the wait must not start)."""
    for budget in _active.get():
        if budget.spent:
            raise BudgetSpent(f"this request has waited {budget.charged:.3f} s on the store, its budget")
        timeout_s = min(timeout_s, budget.left)
    return timeout_s


def capped_s(timeout_s: float) -> float:
    """``timeout_s`` within what every active budget has left, never 0 (a socket given no timeout
    would not block at all): for settings read outside the waits themselves."""
    budgets = _active.get()
    return max(RESOLUTION_S, min((timeout_s, *(b.left for b in budgets)))) if budgets else timeout_s


def charge(waited_s: float) -> None:
    """A wait of ``waited_s`` (what ``wait_s`` gave it) timed out: every active budget pays it."""
    for budget in _active.get():
        budget.charged += waited_s
        budget.timeouts += 1
