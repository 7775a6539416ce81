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
