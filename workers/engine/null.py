"""`SPOOL_ENGINE=null`: deterministic tokens, no model, no arithmetic.

It answers every sequence in one step with the tokens a fixed, prompt-seeded walk over ordinary
words gives, so that the queue path's own cost (API, Postgres, Celery/Redis, worker, Redis stream,
SSE) can be measured with `spool bench` without an engine in the way. It uses the model's real
vocabulary (vocab-only load), so token counts match what the API admitted. Constraints and prompt
scores are refused by the API (core/generation/capabilities.py); log-probabilities are 0.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Hashable
from typing import Any

from core.infra.tokenizers import tokenizer_for
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent, VocabEngine, check_spec

WORDS = " the a quick brown fox jumps over lazy dog and then runs to see what is next in line"


class NullEngine(VocabEngine):
    def __init__(self, model_id: str, *, n_ctx: int, max_batch: int) -> None:
        self.model_id, self.max_batch = model_id, max_batch
        self.vocab: Any = tokenizer_for(model_id)
        self.n_ctx = min(n_ctx, self.vocab.train_context or n_ctx)
        self.n_vocab = self.vocab.n_vocab
        self._words = self.vocab.encode(WORDS, add_special=False)
        self._live: dict[Hashable, SeqSpec] = {}

    def ll_tokenizer(self) -> Any:
        raise NotImplementedError("the null engine does not constrain output")

    def add(self, spec: SeqSpec) -> None:
        check_spec(spec, self.n_ctx, self.n_vocab)
        self._live[spec.key] = spec

    def cancel(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def has_work(self) -> bool:
        return bool(self._live)

    def step(self) -> list[TokenEvent | PromptEvent]:
        now = time.monotonic()
        out: list[TokenEvent | PromptEvent] = []
        for key, spec in list(self._live.items()):
            del self._live[key]
            out.append(PromptEvent(key, 0, None))
            n = spec.max_new_tokens
            start = zlib.crc32(bytes(str(spec.prompt_ids[-8:]) + str(spec.seed), "ascii"))
            lp = 0.0 if spec.params.needs_token_logprobs else None
            for i in range(n):
                tok = self._words[(start + i) % len(self._words)]
                out.append(
                    TokenEvent(key, tok, lp, "length" if i == n - 1 else None, [] if lp is not None else None, now)
                )
            if n == 0:
                out.append(TokenEvent(key, None, None, "length", t=now))
        return out
