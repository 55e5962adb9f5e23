"""Engine-neutral work on one sequence's logits (numpy): log-probabilities and grammar masks."""

from __future__ import annotations

from typing import Any

import numpy as np
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

from workers.engine.base import TopList


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32, copy=False)
    m = x.max()
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum())


def top_logprobs(logp: np.ndarray, k: int) -> TopList:
    """The k most likely tokens with their logprobs, best first."""
    if k <= 0:
        return []
    idx = np.argpartition(-logp, k - 1)[:k]
    idx = idx[np.argsort(-logp[idx], kind="stable")]
    return [(int(i), float(logp[i])) for i in idx]


class GrammarMask:
    """Applies an llguidance matcher's allowed-token set to a logits row, in place."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self._bits = allocate_token_bitmask(1, n_vocab)

    def apply(self, logits: np.ndarray) -> None:
        fill_next_token_bitmask(self.matcher, self._bits)
        apply_token_bitmask_inplace(logits[: self.n_vocab], self._bits[0])

    def consume(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None
