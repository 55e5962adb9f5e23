"""The engine interface every backend implements (llama.cpp now, ExLlamaV2 next).

Deliberately close to ExLlamaV2's dynamic generator (enqueue / iterate / cancel): the engine keeps
its own set of live sequences and advances all of them by one step per `step()` call, batching
where it can. Only the engine loop thread (workers/engine/loop.py) touches an engine.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SeqSpec:
    key: Hashable  # unique among live sequences: (job_id, attempt, choice)
    prompt_ids: list[int]
    max_new_tokens: int  # already clamped to the context by the caller
    temperature: float
    top_p: float
    seed: int
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenEvent:
    key: Hashable
    token_id: int | None  # None when the sequence ended without a new token (EOS, cancel)
    logprob: float | None
    finish_reason: str | None  # "stop" (EOS) | "length" | None while running
    t: float = 0.0  # monotonic time the step finished, for concurrency evidence and latency stats


class Engine(Protocol):
    model_id: str
    n_ctx: int  # context length per sequence
    max_batch: int

    def tokenize(self, text: str) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def add(self, spec: SeqSpec) -> None: ...

    def cancel(self, key: Hashable) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[TokenEvent]: ...
