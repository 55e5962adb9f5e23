"""Token sampling over a logits vector (numpy), for engines that hand us raw logits (llama.cpp).

Per-sequence `numpy.random.Generator` seeded from the request, so a seed replays exactly whatever
else is in the batch.
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max()
    shifted = logits - m
    return shifted - np.log(np.exp(shifted).sum())


def sample(logits: np.ndarray, *, temperature: float, top_p: float, rng: np.random.Generator) -> tuple[int, float]:
    """Pick one token; return it with its log-probability under the unmodified distribution."""
    logits = logits.astype(np.float32, copy=False)
    logp = log_softmax(logits)
    if temperature <= 0.0:
        tok = int(np.argmax(logits))
        return tok, float(logp[tok])
    probs = np.exp(log_softmax(logits / temperature))
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]
        tok = _draw(probs[keep], keep, rng)
    else:
        tok = _draw(probs, None, rng)
    return tok, float(logp[tok])


def _draw(p: np.ndarray, ids: np.ndarray | None, rng: np.random.Generator) -> int:
    # Inverse CDF: one uniform draw per token, far cheaper than Generator.choice(p=...) on 49k entries.
    cum = np.cumsum(p, dtype=np.float64)
    i = min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(p) - 1)
    return int(ids[i]) if ids is not None else i
