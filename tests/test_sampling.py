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
    order, probs = reference_candidates(config, logits)
    return int(order[rng.choice(order.shape[0], p=probs)])


def reference_pick(config: SamplingConfig, logits: np.ndarray, u: float) -> int:
    """The plain rule for one given draw ``u``, as ``Generator.choice`` turns ``u`` into an index."""
    order, probs = reference_candidates(config, logits)
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(order[np.searchsorted(cdf, u, side="right")])


def reference_candidates(config: SamplingConfig, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    return order, probs


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


class FixedDraw:
    """Stands in for a sampler's generator: every draw is ``u``."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def test_sampler_equals_the_plain_rule_around_its_heads():
    """Vocabularies at and around the 64- and 1,024-id heads, ties at the 64th logit, float16 and
    float64 logits, a temperature far below 1 (float64 logits near 1000 that differ by 1e-3: a
    total rounded to float32 picked the wrong token there), and a top_p within rounding of 1."""
    rng = np.random.default_rng(11)
    cases = []
    for vocab in (63, 64, 65, 100, 1024, 1025, 3000):
        for dtype in (np.float16, np.float32, np.float64):
            logits = np.round(rng.standard_normal(vocab) * 2, 1).astype(dtype)
            if vocab > 70:
                logits[np.argsort(-logits)[60:70]] = np.sort(logits)[::-1][63]  # ties across the 64th
            cases.append(logits)
    cases.append(1000 + 1e-3 * np.random.default_rng(4).standard_normal(800))
    for trial, logits in enumerate(cases):
        for config in [SamplingConfig(temperature=1.0, seed=trial), SamplingConfig(temperature=1e-4, seed=trial),
                       SamplingConfig(temperature=0.8, top_p=0.9, seed=trial),
                       SamplingConfig(temperature=1.0, top_p=float(np.nextafter(1.0, 0.0)), seed=trial),
                       SamplingConfig(temperature=1.5, min_p=0.05, seed=trial)]:
            sampler, reference_rng = Sampler(config), np.random.default_rng(config.seed)
            assert [sampler(logits) for _ in range(6)] == [reference_sample(config, logits, reference_rng)
                                                          for _ in range(6)], (trial, config)


def test_a_draw_at_a_boundary_picks_what_the_plain_rule_picks():
    """A draw within a hair of a cumulative boundary inside the first head: the head's total is
    summed in float32, so the head leaves such a draw to the exactly sorted vocabulary."""
    rng = np.random.default_rng(5)
    config = SamplingConfig(temperature=1.0)
    for vocab in (800, 5000):
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        order, probs = reference_candidates(config, logits)
        cdf = np.cumsum(probs) / probs.sum()
        for i in (0, 3, 17, 40):
            for u in (cdf[i] - 1e-9, cdf[i], cdf[i] + 1e-9):
                sampler = Sampler(config)
                sampler._rng = FixedDraw(float(u))
                assert sampler(logits) == reference_pick(config, logits, float(u)), (vocab, i, u)
