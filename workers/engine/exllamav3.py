"""GPU engine: ExLlamaV3's Generator/Job API (exllamav3 1.6.5) behind the engine interface (base.py).

`Generator.enqueue(Job)` per sequence, `iterate()` advances every active job by one token with
continuous batching over a paged cache, `cancel(job)` drops one. Jobs are `job_class` (prefix reuse
within one tenant) with an `OutputPenaltySampler` (presence/frequency over the output only). Its
results have the shape of exllamav2's dynamic generator (stage, identifier, token_ids, top_k_*,
logits, eos, eos_reason, job), so exl2_mapping.events_from_result turns them into events. Logprobs
come from `return_logits`: the job holds the model's row before the sampler stack (which writes its
edits to a new buffer: penalties, bias, the blocked EOS of min_tokens are all out of place), i.e. the
model's own distribution. Grammars run as an exllamav3 `Filter` over our already-advanced llguidance
matcher. Sampler arguments: exl3_mapping. Cache size, batch and chunk: gpu_plan. The scheduling
around the generator (our queue, admission, cancel, step) is exllama_base.ExLlamaEngine's.

exllamav3 and torch are imported only when an engine is built (they need CUDA). What the CI checks of
this module run on the real library with its CUDA extension stubbed: tests/unit/test_gpu_promises.py.
Needs a GPU to verify: tests/gpu/test_exllama_engines.py (what both engines promise) and
tests/gpu/test_exllamav3_engine.py.
"""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path
from typing import Any

from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.exl2_mapping import SeqState, stop_token_ids
from workers.engine.exl3_mapping import Unsupported, job_args, output_window, sampler_args
from workers.engine.exllama_base import ExLlamaEngine, load_ll_tokenizer
from workers.engine.gpu_plan import (
    ClaimsPages,
    cache_salt,
    cap_context,
    clamp_chunk,
    hashing_for,
    own_first_pages_only,
    salted_checksum,
)

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
            # eos_after_completed: the job ends when the grammar does (TabbyAPI passes it too); with
            # False the filter switched itself off and sampling went on unconstrained (`x` -> `x7777`).
            super().__init__(tokenizer, None, None, True)
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


@cache
def job_class() -> type:
    """exllamav3's `Job`, its prefix reuse kept within one scope (tenant); `spool_salt` is set per job
    by `make_job`. The page checksum of `generator/job.py` (pages completed while generating, in
    `hash_completed_page`) and of `generator/pagetable.py` (the prompt's pages, `Sequence.prepare` in
    `prepare_for_queue`) is wrapped (gpu_plan.salted_checksum) so that while this job hashes, its
    chain starts from its tenant's salt: page lookups by hash (VRAM, CPU and disk tiers, recurrent
    checkpoints) find only that tenant's pages, and the partial-page copy in `prefill` (first pages:
    predecessor None) sees only first pages its scope held. First pages keep the library's None
    predecessor, so eviction and defragmentation still see them as the roots of their chains.
    `Job.__init__` runs again on a requeue (same object), which keeps these attributes."""
    import torch
    from exllamav3 import Job
    from exllamav3.generator import job as job_module
    from exllamav3.generator import pagetable

    job_module.tensor_hash_checksum = salted_checksum(job_module.tensor_hash_checksum)
    pagetable.tensor_hash_checksum = salted_checksum(pagetable.tensor_hash_checksum)

    class ScopedJob(ClaimsPages, Job):
        spool_salt: bytes | None = None
        spool_error: str | None = None  # this job's own failure inside iterate(): it alone ends

        def spool_fail(self, where: str, exc: BaseException) -> None:
            if self.spool_error is None:
                log.error("exllamav3 job %r failed in %s", self.identifier, where, exc_info=exc)
                self.spool_error = f"engine error ({where}): {type(exc).__name__}: {exc}"

        def prepare_logit_mask(self, *args: Any, **kwargs: Any) -> Any:
            if self.spool_error is None:
                try:
                    return super().prepare_logit_mask(*args, **kwargs)
                except Exception as exc:  # its grammar's mask: this job's fault, not the batch's
                    self.spool_fail("constraint mask", exc)
            return None

        def receive_logits(self, logits: Any) -> Any:
            if self.spool_error is None:
                try:
                    return super().receive_logits(logits)
                except Exception as exc:  # e.g. the library's NonFiniteLogits, a sampler step
                    self.spool_fail("sampling", exc)
            return torch.zeros((1, 1), dtype=torch.long), None, None, None  # ended unread below

        def receive_sample(self, logits: Any, next_token: Any, *args: Any, **kwargs: Any) -> Any:
            if self.spool_error is None:
                try:
                    return super().receive_sample(logits, next_token, *args, **kwargs)
                except Exception as exc:
                    self.spool_fail("accepting a token", exc)
            # (eos, token, requeue): the generator ends the job and frees its pages as for any EOS;
            # no result is emitted for it, the engine reports `spool_error` instead.
            return True, next_token, False

        def prepare_for_queue(self, *args: Any, **kwargs: Any) -> Any:
            with hashing_for(self.spool_salt):
                return super().prepare_for_queue(*args, **kwargs)

        def hash_completed_page(self, *args: Any, **kwargs: Any) -> Any:
            with hashing_for(self.spool_salt):
                return super().hash_completed_page(*args, **kwargs)

        def prefill(self, *args: Any, **kwargs: Any) -> Any:
            with own_first_pages_only(self.pagetable.all_pages, self.spool_salt):
                return super().prefill(*args, **kwargs)

    return ScopedJob


@cache
def sampler_class() -> type:
    """`ComboSampler` whose presence and frequency penalties count the output only (llama.cpp's engine
    and TabbyAPI do): its `SS_PresFreqP` step takes the last `sustain_range` past ids, prompt included,
    so before each token the range is cut to the tokens generated so far (within the penalty window).
    The repetition penalty keeps its range over prompt and output. The step stays the library's own
    class, so the fused sampling path still takes it."""
    from exllamav3 import ComboSampler
    from exllamav3.generator.sampler.custom import SS_PresFreqP

    class OutputPenaltySampler(ComboSampler):
        def __init__(self, *, output_from: int, output_window: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.output_from = output_from  # where the output starts in the past ids
            self.output_window = output_window

        def forward(self, logits: Any, sequence_ids: Any = None, *args: Any, **kwargs: Any) -> Any:
            if sequence_ids is not None:
                generated = max(sequence_ids.shape[-1] - self.output_from, 0)
                for step in self.steps:
                    if isinstance(step, SS_PresFreqP):
                        step.sustain_range = min(generated, self.output_window)
                        step.decay_range = 0
            return super().forward(logits, sequence_ids, *args, **kwargs)

    return OutputPenaltySampler


def make_job(
    spec: SeqSpec, stop_ids: list[int], filters: list[Any] | None = None, breakers: frozenset[int] | None = None
) -> Any:
    """The generator job for one sequence, scoped to its tenant, with output-only presence/frequency."""
    import torch

    p = spec.params
    sampler = sampler_class()(
        output_from=len(spec.prompt_ids) - spec.prior,  # a resumed sequence's earlier output counts
        output_window=output_window(p),
        **sampler_args(p, breakers),
    )
    ids = torch.tensor([spec.prompt_ids], dtype=torch.long)
    job = job_class()(input_ids=ids, sampler=sampler, **job_args(spec, stop_ids, filters))
    job.spool_salt = cache_salt(spec.cache_scope, p.cache_prompt, spec.key)
    return job


def context_for(config: Any, n_ctx: int) -> int:
    """The context per sequence: the asked one, capped by the model's own maximum as exllamav3's
    `Config` reads it (max_position_embeddings, or text_config's); beyond it positions are untrained."""
    capped = cap_context(n_ctx, int(getattr(config, "max_position_embeddings", 0) or 0))
    if capped < n_ctx:
        log.warning("n_ctx %d is above the model's maximum %d: capped to it", n_ctx, capped)
    return capped


class ExLlamaV3Engine(ExLlamaEngine):
    library = "exllamav3"

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
        path = self._model_folder(path)
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        self._require_cuda()
        self.model_id = model_id
        config = Config.from_directory(str(path))
        self.n_ctx = context_for(config, n_ctx)
        plan = self._fit_cache(path, max_batch, cache_size)
        self.max_batch = plan.max_batch
        self._chunk = clamp_chunk(chunk, n_ctx, plan.cache_tokens)
        self._model = Model.from_config(config)
        kv = Cache(self._model, max_num_tokens=plan.cache_tokens)
        self._model.load(progressbar=False, max_chunk_size=self._chunk)
        tok = Tokenizer.from_config(config)
        gen = Generator(
            model=self._model,
            cache=kv,
            tokenizer=tok,
            max_batch_size=self.max_batch,
            max_chunk_size=self._chunk,
        )
        eos_list = getattr(config, "eos_token_id_list", None) or []
        self.attach(gen, tok, stop_token_ids(tok.eos_token_id, eos_list))
        self._ll = load_ll_tokenizer(path, self.n_vocab, self._stop_ids)
        self._add_bos = bool(getattr(self._tok, "add_bos", False))
        log.info(
            "exllamav3 engine: %s, ctx %d/seq, batch %d, cache %d tokens, chunk %d",
            path.name,
            self.n_ctx,
            self.max_batch,
            plan.cache_tokens,
            self._chunk,
        )

    def attach(self, gen: Any, tok: Any, stop_ids: list[int], n_vocab: int | None = None) -> None:
        """As the base's; the vocabulary is the tokenizer's `actual_vocab_size` unless given."""
        super().attach(gen, tok, stop_ids, int(tok.actual_vocab_size) if n_vocab is None else n_vocab)

    # -- sequences --------------------------------------------------------------------------
    def _check(self, spec: SeqSpec) -> None:
        if spec.prompt_logprobs is not None:
            raise ValueError("not supported by the exllamav3 engine: prompt_logprobs")
        try:
            sampler_args(spec.params)
        except Unsupported as exc:
            raise ValueError(str(exc)) from exc

    def _start(self, spec: SeqSpec) -> list[TokenEvent | PromptEvent]:
        p = spec.params
        if spec.max_new_tokens == 0:
            return [PromptEvent(spec.key, 0), TokenEvent(spec.key, None, None, "length", t=time.monotonic())]
        grammar = None
        if spec.matcher is not None:
            grammar = grammar_filter_class()(self._tok, spec.matcher, self.n_vocab)
        breakers = self._breaker_ids(p.dry_sequence_breakers) if p.dry_multiplier > 0 else None
        job = make_job(spec, self._stop_ids, [grammar] if grammar is not None else None, breakers)
        self._gen.enqueue(job)
        self._live[spec.key] = (job, SeqState(spec.key, p.needs_token_logprobs, p.logprobs or 0, grammar=grammar))
        return []
