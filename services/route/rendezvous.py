"""Which worker a call goes to: rendezvous hashing for keyed calls, round-robin for the others.

Rendezvous (highest-random-weight) hashing scores every worker for a key and takes the highest
score. Why not a modulo or a ring: when a worker joins or leaves, only the keys whose highest score
was that worker move (about 1/N of them), and every other prefix stays with the worker that holds
its K/V in memory; with ``hash % N`` nearly every prefix would move. It needs no shared state
either: every router replica that sees the same workers picks the same one for a key, so routers
scale out without talking to each other. Its cost, one hash per worker per call, is nothing next to
a Generate call for the tens of workers a fleet has.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Candidate(Protocol):
    """A worker as the choice sees it: its address, and this router's Generate streams open to it."""

    @property
    def address(self) -> str: ...

    @property
    def streams(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def score(key: bytes, address: str) -> int:
    """The worker's weight for ``key``: BLAKE2b(key || address) read as a 64-bit unsigned integer.
    Depends on nothing but the two, so it is the same in every router process."""
    return int.from_bytes(hashlib.blake2b(key + address.encode(), digest_size=8).digest(), "big")


def choose(key: bytes, candidates: Sequence[C], max_streams: int = 0) -> C | None:
    """The highest-scoring candidate with fewer than ``max_streams`` streams open (0: no bound);
    when every candidate is at the bound, the least loaded (ties to the higher score), so the call
    still goes somewhere and the worker's own queue decides. None without candidates."""
    ranked = sorted(candidates, key=lambda c: score(key, c.address), reverse=True)
    if not ranked:
        return None
    if max_streams:
        for candidate in ranked:
            if candidate.streams < max_streams:
                return candidate
        return min(ranked, key=lambda c: c.streams)  # min keeps the first of equals: the higher score
    return ranked[0]


class RoundRobin:
    """Takes the candidates in turn, for calls without a key (Tokenize, GetModelInfo, a Generate
    request that does not parse). Candidates are ordered by address, so a set that changes only
    shifts the turn."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[C]) -> C | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda c: c.address)
        self._turn += 1
        return ordered[self._turn % len(ordered)]
