"""The numpy sampler (pure)."""

from __future__ import annotations

import numpy as np

from workers.engine.sampling import sample


def test_greedy_picks_argmax_with_its_logprob():
    logits = np.array([0.0, 3.0, 1.0], dtype=np.float32)
    tok, lp = sample(logits, temperature=0.0, top_p=1.0, rng=np.random.default_rng(0))
    assert tok == 1
    assert np.isclose(lp, 3.0 - np.log(np.exp(logits).sum()))


def test_same_seed_same_draws_and_different_seed_differs():
    logits = np.random.default_rng(1).normal(size=1000).astype(np.float32)

    def draw(seed):
        return [
            sample(logits, temperature=1.0, top_p=1.0, rng=r)[0]
            for r in [np.random.default_rng(seed)]
            for _ in range(50)
        ]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.6, 0.3, 0.05, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)
    seen = {sample(logits, temperature=1.0, top_p=0.8, rng=rng)[0] for _ in range(500)}
    assert seen == {0, 1}


def test_temperature_sharpens():
    logits = np.array([1.0, 0.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    cold = sum(sample(logits, temperature=0.1, top_p=1.0, rng=rng)[0] == 0 for _ in range(300))
    hot = sum(sample(logits, temperature=2.0, top_p=1.0, rng=rng)[0] == 0 for _ in range(300))
    assert cold > 295 and hot < 250
