"""Log-probabilities of tokens under the model's raw distribution: ``log_softmax`` of the logits the
model produced, before penalties, temperature and filters (vLLM's default ``raw_logprobs``), so the
figures a client gets do not depend on how it samples.

Computed on the scheduler thread (two passes over the vocabulary per position); the alternatives'
text is added by the consumer (``with_text``), off the token path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.engine.generation import TokenLogprob, TopLogprob
from services.runtime.tokenizer import TextTokenizer

MAX_TOP_LOGPROBS = 20


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis, in float64 (beam search's few rows)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def log_normalizers(logits: np.ndarray) -> np.ndarray:
    """``logsumexp`` of each row of ``logits`` ``[positions, vocab]`` (float64): a token's
    log-probability is its logit minus its row's. Computed in float32 in one scratch array
    (numpy's pairwise sums keep the error near 1e-7); a float64 copy of a prompt chunk's logits
    (256 positions x 49k tokens) took three times as long on the scheduler thread."""
    peak = logits.max(axis=-1)
    scratch = logits - peak[:, None]
    np.exp(scratch, out=scratch)
    return peak.astype(np.float64) + np.log(scratch.sum(axis=-1).astype(np.float64))


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """One entry per row of ``logits`` ``[positions, vocab]``: ``tokens[i]``'s log-probability at
    row i and, with ``top`` > 0, the ``top`` most likely ids (most likely first, ties by lower id)."""
    norm = log_normalizers(logits)
    chosen = logits[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] - norm
    out = [TokenLogprob(int(t), float(v)) for t, v in zip(tokens, chosen, strict=True)]
    if top:
        vocab = logits.shape[-1]
        k = min(top, vocab)
        # The k-th largest value per row (a value partition costs a third of an index partition),
        # then each row's ids at or above it.
        kth = np.partition(logits, vocab - k, axis=-1)[:, vocab - k]
        for row, entry in enumerate(out):
            pool = np.flatnonzero(logits[row] >= kth[row])
            ids = pool[np.lexsort((pool, -logits[row, pool]))][:k]
            entry.top = [TopLogprob(int(i), float(logits[row, i] - norm[row])) for i in ids]
    return out


def with_text(entries: list[TokenLogprob], tokenizer: TextTokenizer) -> list[TokenLogprob]:
    """Fills each entry's and each alternative's ``text`` (the token decoded alone) in place;
    returns ``entries``."""
    for entry in entries:
        entry.text = tokenizer.decode([entry.token_id])
        for alternative in entry.top:
            alternative.text = tokenizer.decode([alternative.token_id])
    return entries
