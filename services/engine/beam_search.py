"""Beam search as data: the live beams' scores and tokens, the finished hypotheses, and one step.

The semantics follow Hugging Face's ``BeamSearchScorer`` (the proto's GenerateRequest.num_beams
says them in full): each step adds every beam's next-token log-probabilities to its score,
considers the best ``max(2, 1 + stop ids) * num_beams`` continuations over all beams in order, turns those ending in a
stop token (among the first ``num_beams``) into finished hypotheses and keeps the first
``num_beams`` others. A hypothesis ranks by ``sum_logprobs / generated_len ** length_penalty``, its
ending token not counted in ``generated_len`` (at least 1).

``step`` returns, for each kept beam, the row it continues (its parent) and its new token; the
caller reorders the rows' K/V by ``parents`` (one gather per layer) and feeds the tokens. Knows
nothing of slots or the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.engine.generation import BeamSearch


@dataclass(frozen=True, slots=True)
class Hypothesis:
    tokens: list[int]
    """Generated tokens, the ending stop token included when there is one."""
    score: float
    """Length-normalised: sum of log-probabilities / generated_len ** length_penalty."""
    stop_token: int | None
    """The stop token that ended it; None when it ran to max_new_tokens."""


@dataclass(slots=True)
class BeamState:
    options: BeamSearch
    stop_ids: frozenset[int]
    """Tokens that end a hypothesis (EOS unless ignored, and the request's stop token ids)."""
    scores: np.ndarray = field(init=False)
    """Per live beam: the sum of its tokens' log-probabilities (float64)."""
    tokens: np.ndarray = field(init=False)
    """Per live beam: its generated tokens ``[num_beams, steps]`` (int64)."""
    finished: list[Hypothesis] = field(default_factory=list)
    """The best ``num_beams`` finished hypotheses, best first."""
    done: bool = False

    def __post_init__(self) -> None:
        beams = self.options.num_beams
        # All beams start as copies of one prompt: only the first may contribute at step one, or
        # the same continuation would be counted num_beams times.
        self.scores = np.full(beams, -np.inf)
        self.scores[0] = 0.0
        self.tokens = np.zeros((beams, 0), dtype=np.int64)

    def _normalised(self, sum_logprobs: float, generated: int) -> float:
        # numpy's power saturates to inf or 0 where Python's float power raises.
        return float(sum_logprobs / np.power(float(max(generated, 1)), self.options.length_penalty))

    def step(self, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``logprobs`` ``[num_beams, vocab]``: every live beam's next-token log-probabilities,
        penalties applied. Returns ``(parents, tokens)``, one per beam kept (``num_beams`` of them);
        sets ``done`` when no live beam can improve the finished hypotheses."""
        beams = self.options.num_beams
        vocab = logprobs.shape[-1]
        total = logprobs + self.scores[:, None]
        flat = total.ravel()
        # Every stop token of every beam may rank among the best: keeping (1 + stop ids) x beams
        # candidates always leaves num_beams that continue (Hugging Face keeps the same number).
        k = min(max(2, 1 + len(self.stop_ids)) * beams, flat.size)
        pool = np.argpartition(-flat, k - 1)[:k]
        # Best first; ties go to the lower (beam, token) index, as a stable sort of the flat array would.
        candidates = pool[np.lexsort((pool, -flat[pool]))]
        generated = self.tokens.shape[1]
        parents, tokens, scores = [], [], []
        for rank, flat_index in enumerate(candidates):
            parent, token = divmod(int(flat_index), vocab)
            score = float(flat[flat_index])
            if token in self.stop_ids:
                if rank < beams:
                    self._add(Hypothesis([*self.tokens[parent].tolist(), token],
                                         self._normalised(score, generated), token))
                continue
            parents.append(parent)
            tokens.append(token)
            scores.append(score)
            if len(parents) == beams:
                break
        parents_a = np.asarray(parents, dtype=np.int64)
        tokens_a = np.asarray(tokens, dtype=np.int64)
        self.tokens = np.concatenate([self.tokens[parents_a], tokens_a[:, None]], axis=1)
        self.scores = np.asarray(scores, dtype=np.float64)
        self.done = self._is_done(float(flat[candidates[0]]), generated)
        return parents_a, tokens_a

    def _add(self, hypothesis: Hypothesis) -> None:
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.options.num_beams :]

    def _is_done(self, best_candidate: float, generated: int) -> bool:
        """Hugging Face's rule: the best candidate of this step, normalised by the tokens generated
        before it, cannot beat the worst finished hypothesis."""
        if len(self.finished) < self.options.num_beams:
            return False
        if self.options.early_stopping:
            return True
        return self.finished[-1].score >= self._normalised(best_candidate, generated)

    def finalize(self) -> list[Hypothesis]:
        """The best ``num_beams`` hypotheses, best first. A search that ran out of tokens before it
        was done counts its live beams as hypotheses too (they never ended)."""
        if self.done:
            return list(self.finished)
        for tokens, score in zip(self.tokens, self.scores, strict=True):
            self._add(Hypothesis(tokens.tolist(), self._normalised(float(score), tokens.shape[0]), None))
        return list(self.finished)
