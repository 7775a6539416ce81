"""Finds stop strings in streamed text with one Aho–Corasick automaton over all of them.

The automaton is built once per request, in O(total length of the stop strings). Scanning text
costs amortised O(1) per character however many stop strings there are: a request with thousands
of stops slows no other stream. A scan's state is a plain int, so the caller keeps it across pushes
and can also look ahead from it without committing (what TextStream does for text behind an
unfinished character).

A state stands for the longest suffix of the text scanned so far that is a prefix of some stop
string; ``held(state)`` is its length in characters: exactly the text that must be held back,
since it could still become a stop string.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0


@dataclass(frozen=True, slots=True)
class Scan:
    state: int
    """The state after the text (keep it for the next scan)."""
    first_stop: int | None
    """Where the earliest-starting stop string that ends inside the scanned text begins, as an
    offset into that text; negative when it began in earlier text (at most the held characters
    back). None when no stop string ends inside it."""
    length: int = 0
    """The length of that stop string (0 when there is none)."""


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        ends = set()
        for stop in stops:
            node = ROOT
            for char in stop:
                nxt = self._goto[node].get(char)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][char] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                node = nxt
            ends.add(node)
        self._fail = [ROOT] * len(self._goto)
        # Length of the longest stop string that is a suffix of the state's text (0: none): the
        # match to report at a position, the one that starts earliest among those ending there.
        self._match = [self._depth[s] if s in ends else 0 for s in range(len(self._goto))]
        queue = deque(self._goto[ROOT].values())
        while queue:  # breadth first: a failure target is shallower, so its links are final
            node = queue.popleft()
            for char, child in self._goto[node].items():
                fallback = self._fail[node]
                while fallback != ROOT and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                self._fail[child] = self._goto[fallback].get(char, ROOT)
                self._match[child] = self._match[child] or self._match[self._fail[child]]
                queue.append(child)

    def held(self, state: int) -> int:
        """Characters at the end of the scanned text that could begin a stop string."""
        return self._depth[state]

    def scan(self, state: int, text: str) -> Scan:
        """Runs ``text`` from ``state``; O(len(text)) amortised, independent of the stop count."""
        goto, fail, match = self._goto, self._fail, self._match
        first: int | None = None
        length = 0
        for i, char in enumerate(text):
            while state != ROOT and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, ROOT)
            if match[state]:
                start = i + 1 - match[state]
                if first is None or start < first:
                    first, length = start, match[state]
        return Scan(state, first, length)
