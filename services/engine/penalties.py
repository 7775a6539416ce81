"""What a sequence's own tokens do to its next logits: repetition, presence and frequency penalties,
the stop tokens masked until ``min_new_tokens``, and the suppressed ids (every step, and the
first generated token's own); the formulas are the proto's SamplingParams and GenerateRequest.

The state is per sequence and grows one token at a time (``observe``), so a step costs O(vocab)
vector work however long the sequence is: no pass over the history.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np

from services.engine.sampling import SamplingConfig


class LogitsAdjuster:
    """Adjusts one sequence's raw logits ``[vocab]`` before the sampler sees them."""

    def __init__(self, config: SamplingConfig, prompt: Iterable[int], vocab: int, stop_ids: Iterable[int],
                 min_new_tokens: int, suppress: np.ndarray, begin_suppress: np.ndarray) -> None:
        """``suppress`` and ``begin_suppress``: int64 ids in ``[0, vocab)``, read, never written."""
        self.repetition = config.repetition_penalty
        self.presence = config.presence_penalty
        self.frequency = config.frequency_penalty
        self._stop_ids = np.fromiter(stop_ids, dtype=np.int64)
        self._min_new_tokens = min_new_tokens
        self._suppress = suppress
        self._begin_suppress = begin_suppress
        self._generated = 0
        self._seen = np.zeros(vocab, dtype=bool)
        """Token ids in the prompt or generated so far (the repetition penalty's set)."""
        self._counts = np.zeros(vocab, dtype=np.float32)
        """Times each id was generated (the frequency and presence penalties' counts)."""
        self._seen[np.fromiter(prompt, dtype=np.int64)] = True

    @staticmethod
    def needed(config: SamplingConfig, min_new_tokens: int, suppress: np.ndarray, begin_suppress: np.ndarray) -> bool:
        """Whether any adjustment is asked for (else the raw logits go to the sampler unchanged)."""
        return (config.repetition_penalty != 1.0 or config.presence_penalty != 0.0
                or config.frequency_penalty != 0.0 or min_new_tokens > 0
                or suppress.size > 0 or begin_suppress.size > 0)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (or beam search's log-probabilities) with the penalties, then the
        masks applied (-inf, which no penalty then moves); float32 logits stay float32."""
        out = logits.copy()
        if self.repetition != 1.0:
            seen = out[self._seen]
            out[self._seen] = np.where(seen > 0, seen / self.repetition, seen * self.repetition)
        if self.frequency or self.presence:
            out -= self.frequency * self._counts + self.presence * (self._counts > 0)
        if self._generated < self._min_new_tokens and self._stop_ids.size:
            out[self._stop_ids] = -np.inf
        if self._suppress.size:
            out[self._suppress] = -np.inf
        if self._generated == 0 and self._begin_suppress.size:
            out[self._begin_suppress] = -np.inf
        return out

    def observe(self, token: int) -> None:
        """The token the sequence just generated."""
        self._generated += 1
        self._seen[token] = True
        self._counts[token] += 1

    def fork(self) -> LogitsAdjuster:
        """An independent copy (a sample or a beam continuing from the same tokens)."""
        twin = copy.copy(self)
        twin._seen, twin._counts = self._seen.copy(), self._counts.copy()  # the only state that grows
        return twin
