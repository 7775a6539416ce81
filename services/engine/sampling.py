"""Choosing the next token from one position's logits: greedy, temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable their filters; seed None is random."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float64 and sampling is argmax anyway.
        return self.temperature < 1e-5


class Sampler:
    """Picks tokens for one sequence; a seeded sampler repeats its choices for the same logits."""

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """``logits``: float array ``[vocab]`` of the position to continue from."""
        if self.config.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.config.temperature
        vocab = scaled.shape[0]
        k = self.config.top_k if 0 < self.config.top_k < vocab else vocab
        # Candidates sorted by descending logit; ties broken by token id so the order is stable.
        order = np.lexsort((np.arange(vocab), -scaled))[:k]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if self.config.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            keep = int(np.searchsorted(np.cumsum(probs), self.config.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self._rng.choice(order.shape[0], p=probs)])
