"""GPU engine: ExLlamaV3's Generator/Job API (exllamav3 1.6.5) behind the engine interface (base.py).

`Generator.enqueue(Job)` per sequence, `iterate()` advances every active job by one token with
continuous batching over a paged cache, `cancel(job)` drops one. Its results have the shape of
exllamav2's dynamic generator (stage, identifier, token_ids, top_k_*, logits, eos, eos_reason, job),
so exl2_mapping.events_from_result turns them into events. Logprobs come from `return_logits`: the
job holds the model's row before the sampler stack (which writes its edits to a new buffer), i.e.
before penalties, bias and masks. Grammars run as an exllamav3 `Filter` over our already-advanced
llguidance matcher. Sampler arguments: exl3_mapping. Cache size, batch and chunk: gpu_plan.

exllamav3 and torch are imported only when an engine is built (they need CUDA).
Needs a GPU to verify: tests/gpu/test_exllamav3_engine.py.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Hashable
from functools import cache
from pathlib import Path
from typing import Any

from workers.engine.base import PromptEvent, SeqSpec, TokenEvent, check_spec
from workers.engine.exl2_mapping import SeqState, dry_breaker_ids, events_from_result, stop_token_ids
from workers.engine.exl3_mapping import Unsupported, job_args, sampler_args
from workers.engine.gpu_plan import clamp_chunk, kv_bytes_per_token, plan_cache, weights_bytes

log = logging.getLogger(__name__)


@cache
def grammar_filter_class() -> type:
    """An exllamav3 `Filter` driving an llguidance matcher that arrives advanced past the
    sequence's earlier tokens (so `reset`, which the job calls at activation, keeps its state)."""
    import numpy as np
    import torch
    from exllamav3 import Filter

    class MatcherFilter(Filter):
        def __init__(self, tokenizer: Any, matcher: Any, n_vocab: int) -> None:
            super().__init__(tokenizer, None, None, False)
            self.matcher = matcher
            self.bits = np.empty(((n_vocab + 31) // 32,), dtype=np.int32)
            self.bits_torch = torch.from_numpy(self.bits).unsqueeze(0)
            self.error: str | None = None

        def reset(self) -> None:
            pass

        def accept_token(self, token: int) -> None:
            if self.error is None and not self.matcher.is_stopped() and not self.matcher.consume_token(int(token)):
                self.error = self.matcher.get_error() or "token rejected by the grammar"

        def rollback_tokens(self, num_tokens: int) -> bool:
            self.matcher.rollback(num_tokens)
            return not self.matcher.is_error()

        def get_next_logit_mask(self) -> Any:
            self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.size * self.bits.itemsize)
            return self.bits_torch

        def is_completed(self) -> bool:
            return bool(self.matcher.is_stopped())

        def use_background_worker(self) -> bool:
            return True

    return MatcherFilter


class ExLlamaV3Engine:
    def __init__(
        self,
        model_id: str,
        path: Path,
        *,
        n_ctx: int = 2048,
        max_batch: int = 16,
        cache_size: int | None = None,
        chunk: int = 2048,
    ) -> None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"the exllamav3 engine needs a model folder with config.json (SPOOL_MODEL_PATH): {path}")
        import torch
        from exllamav3 import Cache, ComboSampler, Config, Generator, Job, Model, Tokenizer

        if not torch.cuda.is_available():
            raise RuntimeError("the exllamav3 engine needs a CUDA GPU")
        self._torch, self._job_class, self._sampler_class = torch, Job, ComboSampler
        self.model_id = model_id
        raw = json.loads((path / "config.json").read_text())
        config = Config.from_directory(str(path))
        self.n_ctx = n_ctx
        free, _total = torch.cuda.mem_get_info()
        plan = plan_cache(
            free_bytes=free,
            weights_bytes=weights_bytes(path),
            kv_bytes_per_token=kv_bytes_per_token(raw),
            n_ctx=n_ctx,
            max_batch=max_batch,
            requested_tokens=cache_size,
        )  # raises DoesNotFit with the numbers before anything is loaded
        self.max_batch = plan.max_batch
        self._chunk = clamp_chunk(chunk, n_ctx, plan.cache_tokens)
        self._model = Model.from_config(config)
        kv = Cache(self._model, max_num_tokens=plan.cache_tokens)
        self._model.load(progressbar=False, max_chunk_size=self._chunk)
        self._tok = Tokenizer.from_config(config)
        self._gen = Generator(
            model=self._model,
            cache=kv,
            tokenizer=self._tok,
            max_batch_size=self.max_batch,
            max_chunk_size=self._chunk,
        )
        self.n_vocab = int(self._tok.actual_vocab_size)
        eos_list = getattr(config, "eos_token_id_list", None) or []
        self._stop_ids = stop_token_ids(self._tok.eos_token_id, eos_list)
        from workers.engine.exllamav2 import load_ll_tokenizer

        self._ll = load_ll_tokenizer(path, self.n_vocab, self._stop_ids)
        self._add_bos = bool(getattr(self._tok, "add_bos", False))
        self._waiting: collections.deque[SeqSpec] = collections.deque()
        self._ready: list[TokenEvent | PromptEvent] = []
        self._live: dict[Hashable, tuple[Any, SeqState]] = {}
        self._bytes: dict[int, bytes] = {}
        self._breakers: dict[tuple[str, ...], frozenset[int]] = {}
        log.info(
            "exllamav3 engine: %s, ctx %d/seq, batch %d, cache %d tokens, chunk %d",
            path.name,
            self.n_ctx,
            self.max_batch,
            plan.cache_tokens,
            self._chunk,
        )

    # -- tokenizer --------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_bos=self._add_bos, encode_special_tokens=True)
        return ids[0].tolist()

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._bytes.get(token_id)
        if piece is None:
            piece = b"" if self._ll.is_special_token(token_id) else self._ll.decode_bytes([token_id])
            self._bytes[token_id] = piece
        return piece

    def token_text(self, token_id: int) -> str:
        if self._ll.is_special_token(token_id):
            return self._ll.decode_str([token_id])
        return self.token_bytes(token_id).decode(errors="replace")

    def ll_tokenizer(self) -> Any:
        return self._ll

    # -- sequences --------------------------------------------------------------------------
    def add(self, spec: SeqSpec) -> None:
        check_spec(spec, self.n_ctx, self.n_vocab)
        if spec.prompt_logprobs is not None:
            raise ValueError("not supported by the exllamav3 engine: prompt_logprobs")
        try:
            sampler_args(spec.params)
        except Unsupported as exc:
            raise ValueError(str(exc)) from exc
        self._waiting.append(spec)

    def cancel(self, key: Hashable) -> None:
        self._waiting = collections.deque(s for s in self._waiting if s.key != key)
        self._ready = [ev for ev in self._ready if ev.key != key]
        live = self._live.pop(key, None)
        if live is not None:
            try:
                self._gen.cancel(live[0])
            except Exception:  # called from the loop's own error path: never raise here
                log.exception("exllamav3 could not cancel %s", key)

    def has_work(self) -> bool:
        return bool(self._waiting or self._ready or self._live)

    def step(self) -> list[TokenEvent | PromptEvent]:
        out = self._ready + self._admit()
        self._ready = []
        if not self._live and not self._gen.num_remaining_jobs():
            return out
        try:
            results = self._gen.iterate()
        except Exception:
            self._live.clear()
            try:
                self._gen.clear_queue()
            except Exception:
                log.exception("exllamav3 could not clear its queue")
            raise
        now = time.monotonic()
        states = {key: state for key, (_, state) in self._live.items()}
        for result in results:
            out.extend(events_from_result(result, states, n_vocab=self.n_vocab, now=now))
            if result.get("eos"):
                self._live.pop(result.get("identifier"), None)
        return out

    def _admit(self) -> list[TokenEvent | PromptEvent]:
        out: list[TokenEvent | PromptEvent] = []
        while self._waiting and self._gen.num_remaining_jobs() < self.max_batch:
            spec = next((w for w in self._waiting if w.interactive), self._waiting[0])
            self._waiting.remove(spec)
            try:
                self._start(spec)
            except Exception as exc:  # a sequence that cannot start fails alone
                log.exception("could not start sequence %s", spec.key)
                out.append(TokenEvent.failed(spec.key, str(exc), time.monotonic()))
        return out

    def _breaker_ids(self, p: Any) -> frozenset[int]:
        if p.dry_sequence_breakers not in self._breakers:
            pieces = self._tok.get_id_to_piece_list(True)
            self._breakers[p.dry_sequence_breakers] = dry_breaker_ids(p.dry_sequence_breakers, pieces)
        return self._breakers[p.dry_sequence_breakers]

    def _start(self, spec: SeqSpec) -> None:
        torch, p = self._torch, spec.params
        if spec.max_new_tokens == 0:
            self._ready += [PromptEvent(spec.key, 0), TokenEvent(spec.key, None, None, "length", t=time.monotonic())]
            return
        grammar = None
        if spec.matcher is not None:
            grammar = grammar_filter_class()(self._tok, spec.matcher, self.n_vocab)
        job = self._job_class(
            input_ids=torch.tensor([spec.prompt_ids], dtype=torch.long),
            sampler=self._sampler_class(**sampler_args(p, self._breaker_ids(p) if p.dry_multiplier > 0 else None)),
            **job_args(spec, self._stop_ids, [grammar] if grammar is not None else None),
        )
        self._gen.enqueue(job)
        self._live[spec.key] = (job, SeqState(spec.key, p.needs_token_logprobs, p.logprobs or 0, grammar=grammar))
