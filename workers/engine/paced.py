"""`SPOOL_ENGINE=paced`: the null engine's deterministic tokens at a GPU's pace, with no CPU of its own.

A GPU host's decode runs on the GPU; the host CPU is Spool's. This engine models that: each step
advances every live sequence by one token and *sleeps* for as long as a GPU step would take,
`paced_step_ms + paced_seq_ms x live sequences`, and a newly started sequence first sleeps for its
prefill, `prompt tokens / paced_prefill_tps` (defaults: an 8B model at 4 bits on an H100-class GPU).
Sleeping releases the GIL and the core, so on a small machine every cycle stays with the queue path
(API, Postgres, Celery/Redis, worker, Redis stream, SSE), and the engine's own rate is known exactly
(`analytic_tok_s`). `spool bench --mode engine` runs it alone for the reference figure.

It keeps a real engine's scheduling: at most `max_batch` batch sequences decode at once plus
`interactive_slots` for interactive ones; an interactive sequence with every slot busy displaces a
batch one, which keeps its progress and later continues with the same tokens. Tokens are a function
of the original prompt, the seed and the position, so a resumed attempt (prompt + tokens so far)
continues exactly where the dead one stopped. Like the null engine it never stops early (as with
`ignore_eos`), does not constrain output and reports log-probabilities of 0.
"""

from __future__ import annotations

import collections
import time
import zlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from core.infra.tokenizers import tokenizer_for
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent, VocabEngine, check_spec
from workers.engine.null import WORDS


def step_seconds(live: int, step_ms: float, seq_ms: float) -> float:
    """Wall time of one decode step with `live` sequences (the GPU model)."""
    return (step_ms + seq_ms * live) / 1000.0


def analytic_tok_s(live: int, step_ms: float, seq_ms: float) -> float:
    """Output tokens per second the paced engine gives at a steady `live` sequences (prefill excluded)."""
    return live / step_seconds(live, step_ms, seq_ms) if live else 0.0


def token_at(words: list[int], prompt_ids: list[int], prior: int, seed: int, i: int) -> int:
    """The i-th generated token of a sequence (counting the `prior` ones an earlier attempt made)."""
    original = prompt_ids[: len(prompt_ids) - prior] if prior else prompt_ids
    start = zlib.crc32(bytes(str(original[-8:]) + str(seed), "ascii"))
    return words[(start + i) % len(words)]


@dataclass
class _Seq:
    spec: SeqSpec
    done: int = 0  # tokens generated in this attempt
    prefilled: bool = False


class PacedEngine(VocabEngine):
    def __init__(
        self,
        model_id: str,
        *,
        n_ctx: int,
        max_batch: int,
        interactive_slots: int = 4,
        step_ms: float = 8.0,
        seq_ms: float = 0.25,
        prefill_tps: float = 10_000.0,
        sleep: Any = time.sleep,
        clock: Any = time.monotonic,
    ) -> None:
        self.model_id, self.max_batch = model_id, max_batch
        self.vocab: Any = tokenizer_for(model_id)
        self.n_ctx = min(n_ctx, self.vocab.train_context or n_ctx)
        self.n_vocab = self.vocab.n_vocab
        self.step_ms, self.seq_ms, self.prefill_tps = step_ms, seq_ms, prefill_tps
        self.reserved = interactive_slots
        self._sleep, self._clock = sleep, clock
        self._words = self.vocab.encode(WORDS, add_special=False)
        self.live: dict[Hashable, _Seq] = {}
        self.waiting: collections.deque[_Seq] = collections.deque()
        self._inter_waiting = 0  # interactive sequences among `waiting`
        self.preemptions = 0
        self.slept_s = 0.0  # total modelled GPU time (tests and the bench read it)

    def ll_tokenizer(self) -> Any:
        raise NotImplementedError("the paced engine does not constrain output")

    def add(self, spec: SeqSpec) -> None:
        check_spec(spec, self.n_ctx, self.n_vocab)
        self.waiting.append(_Seq(spec))
        self._inter_waiting += spec.interactive

    def cancel(self, key: Hashable) -> None:
        self.live.pop(key, None)
        self.waiting = collections.deque(s for s in self.waiting if s.spec.key != key)
        self._inter_waiting = sum(1 for s in self.waiting if s.spec.interactive)

    def has_work(self) -> bool:
        return bool(self.live or self.waiting)

    def waiting_count(self) -> int:
        return len(self.waiting)

    def waiting_keys(self) -> set[Hashable]:
        return {s.spec.key for s in self.waiting}

    def _admit(self) -> None:
        """Fill free slots, interactive first; an interactive sequence with no slot displaces a batch one.

        Once per step: no scan of the waiting sequences unless one of them is interactive (a bench's
        engine alone holds thousands waiting; a scan per step cost it ~0.25 ms a step)."""
        if not self.waiting:
            return
        batch_live = sum(1 for s in self.live.values() if not s.spec.interactive)
        while self.waiting:
            inter = next((w for w in self.waiting if w.spec.interactive), None) if self._inter_waiting else None
            if inter is not None:
                if len(self.live) >= self.max_batch + self.reserved:
                    victims = [s for s in self.live.values() if not s.spec.interactive]
                    if not victims:
                        return
                    victim = min(victims, key=lambda s: s.done)  # the least progress to set aside
                    del self.live[victim.spec.key]
                    self.waiting.append(victim)  # keeps `done` and `prefilled`: continues with the same tokens
                    self.preemptions += 1
                    batch_live -= 1
                self.waiting.remove(inter)
                self._inter_waiting -= 1
                pick = inter
            elif batch_live < self.max_batch and len(self.live) < self.max_batch + self.reserved:
                pick = self.waiting.popleft()
                batch_live += 1
            else:
                return
            self.live[pick.spec.key] = pick

    def _nap(self, seconds: float) -> None:
        if seconds > 0:
            self._sleep(seconds)
            self.slept_s += seconds

    def step(self) -> list[TokenEvent | PromptEvent]:
        self._admit()
        out: list[TokenEvent | PromptEvent] = []
        fresh = [s for s in self.live.values() if not s.prefilled]
        if fresh:
            self._nap(sum(len(s.spec.prompt_ids) for s in fresh) / self.prefill_tps)
            for s in fresh:
                s.prefilled = True
                out.append(PromptEvent(s.spec.key, 0, None))
        if not self.live:
            return out
        # Choosing the tokens stands for the GPU's sampling, inside its step time: the nap is what
        # is left of the step after it, so this model's own Python does not slow the modelled GPU
        # (it cost the engine alone ~4 % of the exact rate at 64 sequences).
        began, step_s = self._clock(), step_seconds(len(self.live), self.step_ms, self.seq_ms)
        picked: list[tuple[Hashable, int | None, float | None, bool]] = []
        for key, s in list(self.live.items()):
            spec = s.spec
            n = spec.max_new_tokens
            if n <= 0:
                del self.live[key]
                picked.append((key, None, None, True))
                continue
            tok = token_at(self._words, spec.prompt_ids, spec.prior, spec.seed, spec.prior + s.done)
            s.done += 1
            last = s.done >= n
            picked.append((key, tok, 0.0 if spec.params.needs_token_logprobs else None, last))
            if last:
                del self.live[key]
        self._nap(step_s - (self._clock() - began))
        now = time.monotonic()
        for key, token, lp, last in picked:
            if token is None:
                out.append(TokenEvent(key, None, None, "length", t=now))
            else:
                out.append(TokenEvent(key, token, lp, "length" if last else None, [] if lp is not None else None, now))
        return out
