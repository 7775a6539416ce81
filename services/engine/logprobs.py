"""Log-probabilities of tokens under the model's raw distribution: ``log_softmax`` of the logits the
model produced, before penalties, temperature and filters (vLLM's default ``raw_logprobs``), so the
figures a client gets do not depend on how it samples.

Computed on the scheduler thread in float64 (one pass over the vocabulary per position); the
alternatives' text is added by the consumer (``with_text``), off the token path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.engine.generation import TokenLogprob, TopLogprob
from services.runtime.tokenizer import TextTokenizer

MAX_TOP_LOGPROBS = 20


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis, in float64."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """One entry per row of ``logits`` ``[positions, vocab]``: ``tokens[i]``'s log-probability at
    row i and, with ``top`` > 0, the ``top`` most likely ids (most likely first, ties by lower id)."""
    logp = log_softmax(logits)
    chosen = logp[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)]
    out = [TokenLogprob(int(t), float(v)) for t, v in zip(tokens, chosen, strict=True)]
    if top:
        k = min(top, logp.shape[-1])
        pool = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
        for row, entry in enumerate(out):
            ids = pool[row][np.lexsort((pool[row], -logp[row, pool[row]]))]
            entry.top = [TopLogprob(int(i), float(logp[row, i])) for i in ids]
    return out


def with_text(entries: list[TokenLogprob], tokenizer: TextTokenizer) -> list[TokenLogprob]:
    """Fills each alternative's ``text`` (the token decoded alone) in place; returns ``entries``."""
    for entry in entries:
        for alternative in entry.top:
            alternative.text = tokenizer.decode([alternative.token_id])
    return entries
