"""Speculative decoding's pure parts: where draft tokens come from, how they are verified, and when
a sequence stops drafting. No engine here (workers/engine/llamacpp.py uses them; unit-tested alone).

Drafts come from the client's `prediction` (OpenAI's Predicted Outputs) when it sent one, else from
prompt lookup: the continuation of the latest earlier occurrence of the sequence's last few tokens
in its own prompt and output (no draft model).

Verification is "sample, then compare": each position's token is drawn exactly as it would be
without drafts (the same sampler chain, the same random stream, one draw per emitted token), and the
draft token is accepted when the draw equals it. For a deterministic draft token d this accepts d
with probability p(d) and otherwise yields a token from p with d removed and renormalised: the
standard rule, and the output is the output without drafts whenever the logits are the same.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# n-gram sizes tried for a lookup match, longest first: a one-token match drafts noise.
LOOKUP_NGRAMS = (3, 2)
# Tokens of the output's tail a prediction is re-aligned on after a rejection, longest first.
ALIGN_NGRAMS = (4, 3, 2)


class _NgramIndex:
    """End positions of every n-gram (for the sizes given) of a growing token list."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.upto = 0  # n-grams ending at or before this position are indexed

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        for end in range(self.upto + 1, upto + 1):
            for n in self.sizes:
                if end >= n:
                    self.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.upto = max(self.upto, upto)


class Lookup:
    """Prompt-lookup drafts: after the sequence's last n tokens, what followed their latest earlier
    occurrence. Indexed incrementally: a step costs a dictionary lookup, not a scan of the context."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._index = _NgramIndex(LOOKUP_NGRAMS)

    def see(self, tokens: Sequence[int]) -> None:
        """`tokens`: the whole sequence so far (prompt and output); only what is new is read."""
        self.tokens.extend(tokens[len(self.tokens) :])

    def draft(self, k: int) -> list[int]:
        t = self.tokens
        if k <= 0 or len(t) < 2:
            return []
        self._index.extend(t, len(t) - 1)  # not the n-gram ending last: that is the one looked up
        for n in LOOKUP_NGRAMS:
            ends = self._index.ends.get(tuple(t[-n:])) if len(t) > n else None
            if ends:
                e = ends[-1]
                return t[e : e + k]
        return []


class Prediction:
    """Drafts from the client's predicted output. `at` is where the next output token should be in
    it: a token that matches moves it on; one that does not loses the alignment, which is found again
    where the output's last few tokens occur in the prediction (after an edit of a few words the
    output goes on with the prediction's text), the first occurrence at or after the output's own
    length first."""

    def __init__(self, ids: Sequence[int], start: int) -> None:
        self.ids = list(ids)
        self.start = start  # where the output begins in the sequences `see` is given
        self.at: int | None = 0
        self.seen = 0  # output tokens already read
        self._index = _NgramIndex(ALIGN_NGRAMS)
        self._index.extend(self.ids, len(self.ids))

    def see(self, tokens: Sequence[int]) -> None:
        output = tokens[self.start :]
        if len(output) <= self.seen:
            return
        for tok in output[self.seen :]:
            if self.at is not None and self.at < len(self.ids) and self.ids[self.at] == tok:
                self.at += 1
            else:
                self.at = None
        self.seen = len(output)
        if self.at is None:
            self._realign(output)

    def _realign(self, output: Sequence[int]) -> None:
        for n in ALIGN_NGRAMS:
            ends = self._index.ends.get(tuple(output[-n:])) if len(output) >= n else None
            if ends:
                i = bisect.bisect_left(ends, len(output))
                self.at = ends[i] if i < len(ends) else ends[-1]
                return

    def draft(self, k: int) -> list[int]:
        if self.at is None or k <= 0:
            return []
        return self.ids[self.at : self.at + k]


def verify(draft: Sequence[int], sample: Callable[[int], int | None]) -> tuple[list[int | None], int]:
    """Verify a draft: `sample(i)` draws position i's token exactly as plain decoding would (after the
    tokens before it were accepted), or returns None when the sequence ended there. The draft token
    at i is accepted while the draw equals it. Returns every draw (the accepted draft tokens, then the
    first draw that differed, or the draw after the whole draft, or the None that ended it) and how
    many draft tokens were accepted."""
    out: list[int | None] = []
    for i in range(len(draft) + 1):
        tok = sample(i)
        out.append(tok)
        if i == len(draft) or tok != draft[i]:  # (None, an end, is never a draft token)
            break
    return out, len(out) - 1


# A draft row's cost relative to a step's fixed cost, measured for SmolLM2 Q4_1 on 2 cores: one row
# 10.6 ms, each further row +4.3 ms, the rest (6.3 ms) paid once per step however many rows it has.
FIXED_ROWS = 1.5
K_MAX = 8  # per sequence; one sequence's rows in a step stay far below 64 (see workers/engine/llamacpp.py)


def expected_tokens(r: float, k: int) -> float:
    """Tokens a step emits with k draft tokens each accepted with probability r (until one is not)."""
    return float(k + 1) if r >= 1.0 else (1 - r ** (k + 1)) / (1 - r)


def choose_k(r: float, live: int, k_max: int = K_MAX, fixed: float = FIXED_ROWS) -> int:
    """The draft length that maximises a sequence's tokens per unit of step time: its share of the
    step's fixed cost (`fixed` rows over `live` decoding sequences) plus one row per token it feeds.
    Low acceptance or a full batch (a small share) makes every draft a loss: 0."""
    share = fixed / max(1, live)
    return max(range(k_max + 1), key=lambda k: (expected_tokens(r, k) / (share + 1 + k), -k))


@dataclass
class Backoff:
    """A sequence's acceptance estimate: a moving count of accepted draft tokens over verified ones
    (a rejection ends a step's verification, so the tokens after it are not trials). `want` drafts
    what `choose_k` says pays; when that is nothing, a one-token probe every `probe_every` steps
    lets the estimate recover once the text becomes predictable again."""

    prior: float = 0.5
    decay: float = 0.8
    probe_every: int = 16
    _hits: float = field(default=0.0, init=False)
    _trials: float = field(default=0.0, init=False)
    _idle: int = field(default=0, init=False)

    @property
    def rate(self) -> float:
        return (self._hits + 2 * self.prior) / (self._trials + 2)  # two trials' worth of prior

    def want(self, live: int, k_max: int = K_MAX) -> int:
        k = choose_k(self.rate, live, k_max)
        if k:
            self._idle = 0
            return k
        self._idle += 1
        if self._idle >= self.probe_every:
            self._idle = 0
            return min(1, k_max)
        return 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            trials = accepted + (accepted < proposed)
            self._hits = self.decay * self._hits + accepted
            self._trials = self.decay * self._trials + trials
