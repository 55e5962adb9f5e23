"""A worker is ready only after it has generated: before it announces itself (its first heartbeat),
its engine runs a short real generation of a fixed prompt. A model that loads but cannot generate
(a kernel that does not compile for this GPU, Triton without a C compiler, a cache too small for one
sequence) fails here, with the library's own message, instead of failing every client's first request.
"""

from __future__ import annotations

import time
from typing import Any

from core.generation.params import GenerationParams
from workers.engine.base import SeqSpec, TokenEvent

PROMPT = "The quick brown fox"
KEY = ("warm-up", 0, 0)


class WarmupFailed(RuntimeError):
    """The engine loaded but could not generate."""


def warm_up(engine: Any, *, max_new_tokens: int = 4, timeout_s: float = 600.0) -> list[int]:
    """Generate `max_new_tokens` greedy tokens of PROMPT on `engine` (called on the thread that owns it,
    before its loop starts): the token ids, or WarmupFailed saying why not."""
    try:
        ids = engine.tokenize(PROMPT)
        n = max(1, min(max_new_tokens, engine.n_ctx - len(ids)))
        params = GenerationParams(temperature=0.0, max_tokens=n, ignore_eos=True, cache_prompt=False)
        engine.add(SeqSpec(KEY, ids, n, params, seed=0, interactive=True, cache_scope=KEY))
        tokens: list[int] = []
        deadline = time.monotonic() + timeout_s
        while engine.has_work():
            if time.monotonic() > deadline:
                raise WarmupFailed(f"no end after {timeout_s:.0f}s")
            for ev in engine.step():
                if not isinstance(ev, TokenEvent) or ev.key != KEY:
                    continue
                if ev.error is not None:
                    raise WarmupFailed(ev.error)
                if ev.token_id is not None:
                    tokens.append(ev.token_id)
                if ev.ended:
                    engine.cancel(KEY)  # nothing of it stays in the engine
    except WarmupFailed:
        raise
    except Exception as exc:  # the library's own words
        raise WarmupFailed(f"{type(exc).__name__}: {exc}") from exc
    if not tokens:
        raise WarmupFailed("the engine ended the sequence without generating a token")
    return tokens
