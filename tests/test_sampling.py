"""Sampling: greedy, filters, and seeded reproducibility."""

import numpy as np

from services.engine.sampling import Sampler, SamplingConfig

LOGITS = np.random.default_rng(0).standard_normal(256).astype(np.float32) * 3


def draws(config: SamplingConfig, n: int = 64) -> list[int]:
    sampler = Sampler(config)
    return [sampler(LOGITS) for _ in range(n)]


def test_greedy_is_argmax():
    assert draws(SamplingConfig()) == [int(np.argmax(LOGITS))] * 64


def test_same_seed_same_tokens_other_seed_other_tokens():
    config = SamplingConfig(temperature=1.0, seed=42)
    assert draws(config) == draws(config)
    assert draws(config) != draws(SamplingConfig(temperature=1.0, seed=43))


def test_top_k_one_and_tiny_top_p_are_greedy():
    argmax = int(np.argmax(LOGITS))
    assert set(draws(SamplingConfig(temperature=1.5, top_k=1, seed=1))) == {argmax}
    assert set(draws(SamplingConfig(temperature=1.5, top_p=1e-6, seed=1))) == {argmax}


def test_top_k_limits_the_candidates():
    allowed = set(np.argsort(-LOGITS)[:5].tolist())
    assert set(draws(SamplingConfig(temperature=5.0, top_k=5, seed=2), 500)) <= allowed


def reference_sample(config: SamplingConfig, logits: np.ndarray, rng: np.random.Generator) -> int:
    """The sampling rule written plainly: full lexicographic sort (descending logit, then id)."""
    scaled = logits.astype(np.float64) / config.temperature
    vocab = scaled.shape[0]
    k = config.top_k if 0 < config.top_k < vocab else vocab
    order = np.lexsort((np.arange(vocab), -scaled))[:k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if config.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), config.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    if config.min_p > 0.0:
        keep = int(np.count_nonzero(probs >= config.min_p * probs.max()))
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(order.shape[0], p=probs)])


def test_sampler_equals_the_plain_rule_including_ties():
    """Also past the sampler's sorted heads (HEADS candidates): vocabularies of 800 and 5000, flat
    logits whose draws often land beyond the head, filters that reach past it."""
    rng = np.random.default_rng(9)
    for trial in range(40):
        # Rounded logits make many exact ties, also at the top-k boundary.
        vocab, scale = (800, 3) if trial % 4 < 2 else (5000, 1 + trial % 3)
        logits = np.round(rng.standard_normal(vocab) * scale, 0 if trial % 2 else 3).astype(np.float32)
        for config in [SamplingConfig(temperature=0.7, seed=trial), SamplingConfig(temperature=1.3, top_k=7, seed=trial),
                       SamplingConfig(temperature=0.9, top_k=50, top_p=0.8, seed=trial),
                       SamplingConfig(temperature=1.0, top_p=0.5, seed=trial),
                       SamplingConfig(temperature=2.0, top_p=0.99, seed=trial),
                       SamplingConfig(temperature=1.0, top_k=3000, seed=trial),
                       SamplingConfig(temperature=1.0, min_p=0.02, seed=trial),
                       SamplingConfig(temperature=3.0, min_p=0.001, seed=trial)]:
            sampler, reference_rng = Sampler(config), np.random.default_rng(config.seed)
            assert [sampler(logits) for _ in range(8)] == [reference_sample(config, logits, reference_rng) for _ in range(8)]
