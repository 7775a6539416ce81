"""Places at a worker's door for calls whose bodies or work are large: requests with audio (their
bodies up to the message limit, up to ~1.4 s of decoding) and Tokenize calls (up to a context's
worth of text to tokenize, beside no slot that would bound them).

A face takes a ``Ticket`` before it reads the call's body, so a call refused here has cost the
worker its headers only, and a flood of such calls holds at most ``capacity`` bodies in memory.
The ticket is given back once the work it admits is done (audio: the request prepared; Tokenize:
its answer made), or when the call ends before that.

Invariants: at most ``capacity`` tickets are out at once, and at most ``per_client`` of them to one
client (``fair_share.client_of``), so one client cannot take every place; a refusal is decided at
once (``Overloaded``, counted in ``refused``), never by waiting. A place whose call has not sent its
body yet (``Ticket.waiting``) can be taken back: when every place is out, a client holding fewer
places than the one holding most takes the oldest such place of that client, whose call is refused
(its ``on_revoke``), so calls that never send their bodies cannot keep other clients out.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from services.errors import Overloaded


def client_part(capacity: int) -> int:
    """Places one client may hold: half of them, rounded up (all of one)."""
    return max(1, (capacity + 1) // 2)


@dataclass(slots=True)
class Tickets:
    """Places of one kind of call; ``what`` names the calls in refusals."""

    capacity: int
    what: str
    flag: str
    """The setting of ``capacity``, named in refusals."""
    per_client: int = 0
    """0: ``client_part(capacity)``."""
    held: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    revoked: int = 0
    _waiting: list[Ticket] = field(default_factory=list, repr=False)
    """Places whose calls have not sent their bodies yet, oldest first."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.per_client:
            self.per_client = client_part(self.capacity)

    @property
    def holding(self) -> int:
        return sum(self.held.values())

    def take(self, client: str) -> Ticket:
        """A place for ``client``'s call, or ``Overloaded`` at once."""
        with self._lock:
            if self.holding >= self.capacity and self.held[client] < self.per_client:
                self._take_back(client)
            if (total := self.holding) >= self.capacity:
                self.refused += 1
                raise Overloaded(f"{total} {self.what} already in progress, the most this worker takes ({self.flag} "
                                 f"{self.capacity}); retry later or on another replica")
            if self.held[client] >= self.per_client:
                self.refused += 1
                raise Overloaded(f"this client ({client or 'in-process'}) already has {self.held[client]} {self.what} in "
                                 f"progress, the most one client may ({self.per_client}: half of {self.flag} "
                                 f"{self.capacity}); wait for them to end")
            self.held[client] += 1
        return Ticket(self, client)

    def _take_back(self, client: str) -> None:
        """Revokes the oldest waiting place of the client holding the most places, when it holds
        more than ``client`` would with one more (lock held)."""
        most = max((t.client for t in self._waiting), key=lambda c: self.held[c], default=None)
        if most is None or self.held[most] <= self.held[client] + 1:
            return
        ticket = next(t for t in self._waiting if t.client == most)
        self._waiting.remove(ticket)
        self.revoked += 1
        ticket.revoked = True
        self._free(ticket)
        if ticket.on_revoke is not None:
            ticket.on_revoke()

    def _free(self, ticket: Ticket) -> None:
        ticket.open = False
        self.held[ticket.client] -= 1
        if not self.held[ticket.client]:
            del self.held[ticket.client]

    def _give_back(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            if ticket.open:
                self._free(ticket)

    def _wait(self, ticket: Ticket, on_revoke: Callable[[], None] | None) -> None:
        with self._lock:
            ticket.on_revoke = on_revoke
            if on_revoke is None:
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
            elif ticket.open:
                self._waiting.append(ticket)


@dataclass(slots=True, eq=False)
class Ticket:
    """One place, held until ``release`` (idempotent); a context manager that releases it."""

    tickets: Tickets
    client: str
    open: bool = True
    revoked: bool = False
    """Taken back for another client's call (it is no longer held)."""
    on_revoke: Callable[[], None] | None = None

    def waiting(self, on_revoke: Callable[[], None] | None) -> None:
        """``on_revoke``: this place's call has not sent its body yet, and is ended by calling it
        if the place is taken back (called under the tickets' lock, on the thread taking it: it
        must only schedule the ending). None: the body came; the place can no longer be taken."""
        self.tickets._wait(self, on_revoke)

    def release(self) -> None:
        if self.open:
            self.tickets._give_back(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
