"""Turns a stream of generated token ids into a stream of text deltas.

Invariants:
- Concatenating every delta gives ``decode(all ids)``, cut before the first stop string.
- No delta ends inside a UTF-8 character: a window that decodes to a trailing U+FFFD (bytes of an
  unfinished character) is held until the character completes or the stream ends.
- Text that could be the start of a stop string is held back until it is known not to be one, so
  a stop string is never sent, even in part (unless ``include_stop``: then the text ends with it).
- A stop string completed while the stream is not ``armed`` (before min_new_tokens) is sent as
  text like any other and ends nothing.

Stop strings are found by one Aho–Corasick automaton (services/engine/stop_matcher.py) whose state
follows the text across pushes: the cost per token grows with the token's text, never with the
number of stop strings. When a piece of text completes several stop strings, the output is cut
before the one that starts first.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.stop_matcher import ROOT, StopMatcher
from services.runtime.tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] | StopMatcher = (), include_stop: bool = False) -> None:
        """``stop``: the stop strings, or their automaton built beforehand (off the event loop:
        building takes milliseconds for many long stop strings)."""
        self._include_stop = include_stop
        self.matched: str | None = None
        """The stop string that ended the stream."""
        self._tokenizer = tokenizer
        self._stops = stop if isinstance(stop, StopMatcher) else StopMatcher(stop) if stop else None
        self._state = ROOT
        self._ids: list[int] = []
        # Decoding only the window ids[_prefix:] keeps each step O(window), not O(output).
        self._prefix = 0
        self._read = 0
        self._unsent = ""
        self.stopped = False

    def push(self, token_id: int, armed: bool = True) -> str:
        """Adds one token; returns the text that can be sent now (possibly empty). Stop strings end
        the stream only while ``armed``."""
        self._ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
            # Held back; but a stop string completed before the unfinished character ends the
            # stream now rather than after it.
            settled = new_text[len(prefix_text) :].rstrip(_REPLACEMENT)
            if armed and self._stops and self._stops.scan(self._state, settled).first_stop is not None:
                return self._release(settled, final=False)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return self._release(new_text[len(prefix_text) :], final=False, armed=armed)

    def finish(self) -> str:
        """Ends the stream; returns whatever text is still held."""
        if self.stopped:
            return ""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        tail = self._tokenizer.decode(self._ids[self._prefix :])[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        return self._release(tail, final=True)

    def _release(self, delta: str, final: bool, armed: bool = True) -> str:
        self._unsent += delta
        if self._stops is None:
            out, self._unsent = self._unsent, ""
            return out
        scan = self._stops.scan(self._state, delta)
        self._state = scan.state
        if scan.first_stop is not None and armed:
            # The stop string began at most the held characters back: inside _unsent.
            self.stopped = True
            start = len(self._unsent) - len(delta) + scan.first_stop
            self.matched = self._unsent[start : start + scan.length]
            end = start + scan.length if self._include_stop else start
            out, self._unsent = self._unsent[:end], ""
            return out
        hold = 0 if final else self._stops.held(self._state)
        out = self._unsent[: len(self._unsent) - hold]
        self._unsent = self._unsent[len(out) :]
        return out
