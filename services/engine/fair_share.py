"""Fair shares of a worker between its clients: who a caller is, how many rows each holds, and
which rows give way when another client waits.

A client is its tenant where API keys name one, else the address it connects from (its port
left out: every connection of one machine is one client). Behind ``kvshare route`` without API
keys every call comes from the router's address, so the fleet's callers are one client there.

Every row a client holds counts from the moment its request passes the door (before tokenizing)
until it ends: being prepared, queued or holding a slot. A client alone may use the whole worker;
the shares are kept when clients contend (``Scheduler``): a request that finds the worker full
takes the queue place of the newest queued request of the client holding the most rows (while
that client holds more than the newcomer would), the next free slot goes to the client holding
the fewest, and a client holding more than its fair part of the slots gives up the streams it
does not read. ``max_rows`` adds a fixed bound per client. The counts live under the scheduler's
lock (``Lifecycle.cond``); nothing here locks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ANONYMOUS = ""
"""The client of in-process callers, which name none."""
FORWARDED_ADDRESS = "kvshare-client-address"
"""gRPC metadata by which the HTTP face in the same process names its caller's address. Trusted
only on the face's private Unix socket (a directory only the worker's user can enter); a call over
TCP that carries it is counted by its own address."""


def client_of(tenant: str, peer: str, forwarded: str | None = None) -> str:
    """The client a call counts against: ``tenant:<id>`` when authenticated, else ``peer:<host>``
    from gRPC's peer string (``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:5000``, ``unix:/path``), or
    the ``forwarded`` address (``FORWARDED_ADDRESS``) of a call that came over a Unix socket."""
    if tenant:
        return f"tenant:{tenant}"
    if forwarded and peer.startswith("unix:"):
        return f"peer:{forwarded}"
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, port = address.rpartition(":")
        address = host if port.isdigit() else address
    return f"peer:{address}" if address else ANONYMOUS


@dataclass(slots=True)
class ClientShares:
    """Rows each client holds (being prepared, queued or holding a slot), and the rows reserved at
    the door whose requests are still being prepared."""

    max_rows: int = 0
    """Rows one client may hold; one more request is refused at the door (0: no fixed bound)."""
    held: Counter[str] = field(default_factory=Counter)
    reserved: int = 0
    """Rows of every client that passed the door and are being prepared (not yet queued or started)."""

    def over(self, client: str, rows: int) -> bool:
        return bool(self.max_rows) and self.held[client] + rows > self.max_rows

    def take(self, client: str, rows: int) -> None:
        self.held[client] += rows
        self.reserved += rows

    def placed(self, rows: int) -> None:
        """Reserved rows were queued or started: they stay held, no longer reserved."""
        self.reserved -= rows

    def release(self, client: str, rows: int) -> None:
        self.held[client] -= rows
        if self.held[client] <= 0:
            del self.held[client]


def fair_slots(max_batch: int, clients: int) -> int:
    """Slots each of ``clients`` clients (running or waiting) is entitled to while they contend: an
    equal part of the batch, at least one."""
    return max(1, max_batch // max(1, clients))
