"""Driving an engine in the GPU tests: a SeqSpec from text, specs run until the engine is idle, and
what the events say."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from typing import Any

from core.generation.params import GenerationParams
from workers.engine.base import SeqSpec, TokenEvent

PROMPT = "Once upon a time, in a land far away, there lived"


def spec(engine: Any, key: Hashable, n: int, prompt: str = PROMPT, scope: Hashable = None, **params: Any) -> SeqSpec:
    p = GenerationParams(**{"seed": 7, **params})
    ids = engine.tokenize(prompt)
    extra = {}
    if p.prompt_logprobs is not None:
        extra = {"prompt_logprobs": p.prompt_logprobs, "prompt_logprobs_len": len(ids)}
    return SeqSpec(key=key, prompt_ids=ids, max_new_tokens=n, params=p, seed=p.seed, cache_scope=scope, **extra)


def run(engine: Any, specs: list[SeqSpec], max_steps: int = 5000) -> dict[Hashable, list]:
    for s in specs:
        engine.add(s)
    out: dict[Hashable, list] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for ev in engine.step():
            out[ev.key].append(ev)
    raise AssertionError("engine did not finish")


def tokens(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id is not None]


def finish(events: list) -> str | None:
    return next((e.finish_reason for e in events if isinstance(e, TokenEvent) and e.finish_reason), None)
