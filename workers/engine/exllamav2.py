"""GPU engine: ExLlamaV2's dynamic generator (exllamav2 0.3.2) behind the llama.cpp engine's interface.

The dynamic generator is what base.py was modelled on: `enqueue` a job per sequence, `iterate()`
advances every active job by one token (prefilling new prompts in chunks between), `cancel` drops a
job. With flash-attn (>= 2.5.7) its cache is paged: jobs are batched continuously and a prompt whose
leading 256-token pages are already cached by an earlier job of the same tenant skips them (job_class
keeps tenants apart). Without flash-attn it runs unpaged, one job at a time. The scheduling around the
generator (our queue, admission, cancel, step) is exllama_base.ExLlamaEngine's, shared with exllamav3.

What the mapping cannot express is done here with the model at hand: logit bias as a padded
vocabulary tensor, DRY breakers as token ids, the llguidance grammar as an `ExLlamaV2Filter`, and
prompt scoring (echo with logprobs, prompt_logprobs) as one plain forward pass, because the
generator's prefill keeps no logits. exllamav2 and torch are imported only when an engine is built:
exllamav2 compiles or loads a CUDA extension at import, which fails on a machine without CUDA.
"""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.exl2_mapping import (
    CACHE_CLASSES,
    SeqState,
    cache_tokens,
    chunk_size,
    job_arguments,
    logit_bias_pairs,
    output_penalties,
    prompt_entries,
    sampler_settings,
    stop_token_ids,
    unsupported,
)
from workers.engine.exllama_base import ExLlamaEngine, load_ll_tokenizer
from workers.engine.gpu_plan import (
    UNCLAIMED,
    ClaimsPages,
    cache_salt,
    exl2_lengths,
    hashing_for,
    own_first_pages_only,
    salted_checksum,
)

KV_BYTES = {"fp16": 2, "q8": 1, "q6": 1, "q4": 1}  # bytes per cached K/V value, rounded up (scales included)

log = logging.getLogger(__name__)

SCORE_ROWS = 256  # prompt positions per log-softmax when scoring: bounds the float32 buffer


@cache
def grammar_filter_class() -> type:
    """`ExLlamaV2Filter` subclass driving an llguidance matcher (built on first use: the base class
    lives in exllamav2).

    It takes the generator's logit-mask path (`can_mask_logits`): `prepare_logit_mask` computes the
    allowed-token bitmask, in the generator's filter thread pool while the GPU runs the next forward
    pass (`use_background_worker`), and `mask_logits` applies it. When the grammar is complete or has
    failed, llguidance allows only EOS, which is a stop token of every job, so the job ends there.
    """
    from exllamav2.generator.filters import ExLlamaV2Filter
    from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    class LLGuidanceFilter(ExLlamaV2Filter):
        def __init__(self, model: Any, tokenizer: Any, matcher: Any, n_vocab: int) -> None:
            super().__init__(model, tokenizer)
            self.matcher = matcher
            self.n_vocab = n_vocab
            self.bits = allocate_token_bitmask(1, n_vocab)
            # Set on the loop thread (in feed), read by the engine: the matcher itself may be busy in
            # the filter pool, and it must not be touched from two threads at once.
            self.error: str | None = None

        def clone(self, c: Any = None) -> Any:
            c = c if c is not None else LLGuidanceFilter.__new__(LLGuidanceFilter)
            super().clone(c)
            c.matcher = self.matcher.deep_copy()
            c.n_vocab = self.n_vocab
            c.bits = self.bits.copy()
            c.error = self.error
            c.background_result = None
            return c

        def begin(self, prefix_str: str = "") -> None:
            pass  # the matcher arrives already advanced past the sequence's earlier tokens

        def feed(self, token: Any) -> None:
            if self.error is None and not self.matcher.consume_token(int(token)):
                self.error = self.matcher.get_error() or "token rejected by the grammar"

        def use_background_worker(self) -> bool:
            return True

        def can_mask_logits(self) -> bool:
            return True

        def prepare_logit_mask(self) -> bool:
            fill_next_token_bitmask(self.matcher, self.bits)
            return True

        def mask_logits(self, logits: Any) -> Any:
            # A masked copy: the row the job returns for logprobs stays the model's (llama.cpp's
            # engine also reports logprobs from before the grammar mask).
            out = logits.clone()
            row = out.numpy()
            apply_token_bitmask_inplace(row[: self.n_vocab], self.bits[0])
            row[self.n_vocab :] = -np.inf  # head padding beyond the vocabulary
            return out

        def next(self) -> tuple[list[int], list[int]]:
            """The allowed-list path (used only if some other filter cannot mask logits)."""
            self.prepare_logit_mask()
            bits = np.unpackbits(self.bits[0].view(np.uint8), bitorder="little")[: self.n_vocab]
            return np.flatnonzero(bits).tolist(), []

    return LLGuidanceFilter


@cache
def job_class() -> type:
    """`ExLlamaV2DynamicJob` keeping the CPU engine's promises (built on first use: the base class
    lives in exllamav2). Set on each job by `make_job`: `spool_salt`, `spool_output_from`,
    `spool_penalties`.

    - Prefix reuse within one scope (tenant) only: the job hashes its pages (`prepare_for_queue`:
      `page_hashes`, `all_unique_hashes`; `receive_sample`: a page completed while generating) with
      its tenant's salt as the chain root (gpu_plan.salted_checksum on the module's
      `_tensor_hash_checksum`), so pages of another tenant never match by hash; the partial-page copy
      in `prefill`, keyed by the predecessor hash (None for a first page), sees only first pages its
      scope held. Unpaged (one page, no flash-attn), the page the last job left is reused only by the
      same scope. `cached_pages`/`cached_tokens`, what the job reports, count only those reuses.
    - `receive_logits` hands the sampler a copy of the row when logprobs are asked for:
      `ExLlamaV2Sampler.sample` edits its row in place (penalties, blocked EOS, bias, DRY), and the
      generator then stores that same row as the job's returned logits. Ours stays the model's.
    - Presence and frequency penalties count the output only (exl2_mapping.output_penalties).
    """
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, dynamic

    dynamic._tensor_hash_checksum = salted_checksum(dynamic._tensor_hash_checksum)

    class ScopedJob(ClaimsPages, ExLlamaV2DynamicJob):
        spool_salt: bytes | None = None
        spool_output_from: int = 0  # where this sequence's output starts in sequence_ids
        spool_penalties: tuple[float, float] = (0.0, 0.0)  # presence, frequency over the output
        spool_error: str | None = None  # this job's own failure inside iterate(): it alone ends

        def spool_fail(self, where: str, exc: BaseException) -> None:
            if self.spool_error is None:
                log.error("exllamav2 job %r failed in %s", self.identifier, where, exc_info=exc)
                self.spool_error = f"engine error ({where}): {type(exc).__name__}: {exc}"

        def prepare_for_queue(self, generator: Any, serial_number: int) -> Any:
            with hashing_for(self.spool_salt):
                return super().prepare_for_queue(generator, serial_number)

        def allocate_pages(self) -> Any:
            gen = self.generator
            last_scope = getattr(gen.all_pages[0], "spool_scope", UNCLAIMED)
            out = super().allocate_pages()  # the library's, then claimed for this scope (ClaimsPages)
            if not gen.paged and last_scope != self.spool_salt:
                # One page, which keeps what the last job left as a prefix to reuse (its length is
                # `kv_position_revert`, the backup taken as the page was handed to this job): not
                # another scope's.
                gen.all_pages[0].kv_position_revert = 0
            return out

        def prefill(self, results: list[Any]) -> Any:
            # exllamav2 contains no job's failure: one raising here lost the whole batch's step. It
            # ends alone (the engine cancels it after the step); its prefill stays undone meanwhile.
            if self.spool_error is not None:
                return None
            try:
                if not self.generator.paged:
                    return super().prefill(results)
                with own_first_pages_only(self.generator.all_pages, self.spool_salt):
                    return super().prefill(results)
            except Exception as exc:
                self.spool_fail("prefill", exc)
                return None

        def receive_logits(self, logits: Any) -> Any:
            if self.spool_error is None:
                try:
                    return self._spool_receive_logits(logits)
                except Exception as exc:  # its sampler, its grammar's mask: this job's fault alone
                    self.spool_fail("sampling", exc)
            return torch.zeros((1, 1), dtype=torch.long), None, None, None, False  # ended unread below

        def _spool_receive_logits(self, logits: Any) -> Any:
            row = logits.clone() if self.return_logits else logits
            presence, frequency = self.spool_penalties
            if presence or frequency:
                out = self.sequences[0].sequence_ids.torch()[0, self.spool_output_from :]
                if out.numel():
                    counts = torch.bincount(out, minlength=row.shape[-1])[: row.shape[-1]].to(row.dtype)
                    row[..., :] -= counts * frequency + (counts > 0).to(row.dtype) * presence
            return super().receive_logits(row)

        def receive_sample(self, logits: Any, next_token: Any, *args: Any, **kwargs: Any) -> Any:
            if self.spool_error is None:
                try:
                    with hashing_for(self.spool_salt):
                        return super().receive_sample(logits, next_token, *args, **kwargs)
                except Exception as exc:
                    self.spool_fail("accepting a token", exc)
            # (eos, token): the generator ends the job and frees its pages as for any EOS; no result
            # is emitted for it, the engine reports `spool_error` instead.
            return True, next_token

    return ScopedJob


def make_job(spec: SeqSpec, stop_ids: list[int], settings: Any, filters: list[Any] | None = None) -> Any:
    """The generator job for one sequence (job_class), scoped to its tenant."""
    import torch

    job = job_class()(
        input_ids=torch.tensor([spec.prompt_ids], dtype=torch.long),
        gen_settings=settings,
        filters=filters,
        **job_arguments(spec, stop_ids),
    )
    job.spool_salt = cache_salt(spec.cache_scope, spec.params.cache_prompt, spec.key)
    job.spool_output_from = len(spec.prompt_ids) - spec.prior  # a resumed sequence's earlier output counts
    job.spool_penalties = output_penalties(spec.params)
    return job


def gen_settings(p: Any, n_vocab: int, padded_vocab: int, breakers: frozenset[int] | None = None) -> Any:
    """A fresh `ExLlamaV2Sampler.Settings` for one job (Mirostat's mu and DRY's n-gram trie live in
    it), with logit bias as the padded-vocabulary tensor the sampler adds to every row."""
    import torch
    from exllamav2.generator import ExLlamaV2Sampler

    kw = sampler_settings(p, breakers)
    pairs = logit_bias_pairs(kw["token_bias"], n_vocab)
    if pairs:
        bias = torch.zeros(padded_vocab, dtype=torch.float)
        bias[[t for t, _ in pairs]] = torch.tensor([b for _, b in pairs], dtype=torch.float)
        kw["token_bias"] = bias
    return ExLlamaV2Sampler.Settings(**kw)


class ExLlamaV2Engine(ExLlamaEngine):
    library = "exllamav2"

    def __init__(
        self,
        model_id: str,
        path: Path,
        *,
        n_ctx: int = 2048,
        max_batch: int = 16,
        cache_size: int | None = None,
        cache_quant: str = "fp16",
        chunk: int = 2048,
        warmup: bool = True,
    ) -> None:
        path = self._model_folder(path)
        if cache_quant not in CACHE_CLASSES:
            raise ValueError(f"cache quantization must be one of {sorted(CACHE_CLASSES)}, not {cache_quant!r}")
        from exllamav2.attn import has_flash_attn_with_paged

        self._torch = self._require_cuda()
        self.model_id = model_id
        self._chunk = chunk_size(chunk)
        config = self._read_config(path, n_ctx)
        # arch_compat_overrides turns flash-attn off for models it cannot serve (softcap, sliding window).
        paged = bool(has_flash_attn_with_paged) and not config.no_flash_attn
        if not paged:
            log.warning(
                "exllamav2: no paged attention (flash-attn >= 2.5.7 not importable, or off for this model): "
                "one sequence at a time (max_batch 1), no continuous batching"
            )
        self.max_batch = max_batch if paged else 1
        size = cache_tokens(self.n_ctx, self.max_batch, cache_size, paged)
        if paged:  # what was asked for, capped by free GPU memory
            plan = self._fit_cache(path, self.max_batch, size, KV_BYTES[cache_quant])
            size, self.max_batch = plan.cache_tokens, plan.max_batch
        self._load(config, CACHE_CLASSES[cache_quant], size, paged)
        if warmup:
            self._gen.warmup()  # kernel autotuning happens here rather than in the first request
        self._load_vocabulary(config, path)
        self.attach(self._gen, self._tok, self._stop_ids, self.n_vocab)
        log.info(
            "exllamav2 engine: %s, ctx %d/seq, batch %d, cache %d tokens (%s), chunk %d, %s",
            path.name,
            self.n_ctx,
            self.max_batch,
            size,
            cache_quant,
            self._chunk,
            "paged" if paged else "unpaged",
        )

    def _read_config(self, path: Path, n_ctx: int) -> Any:
        from exllamav2 import ExLlamaV2Config

        config = ExLlamaV2Config(str(path))
        config.arch_compat_overrides()
        # Any n_ctx starts: the model is configured for whole pages, the chunk fits in them.
        self.n_ctx, config.max_seq_len, self._chunk = exl2_lengths(n_ctx, config.max_seq_len, self._chunk)
        config.max_input_len = self._chunk  # the generator's prefill chunk may not exceed it
        config.max_attention_size = self._chunk**2
        return config

    def _load(self, config: Any, cache_class: str, size: int, paged: bool) -> None:
        """Weights (split over the visible GPUs), the paged KV cache and the dynamic generator."""
        import exllamav2
        from exllamav2 import ExLlamaV2, ExLlamaV2Tokenizer
        from exllamav2.generator import ExLlamaV2DynamicGenerator

        self._model = ExLlamaV2(config)
        kv = getattr(exllamav2, cache_class)(self._model, max_seq_len=size, lazy=True)
        self._model.load_autosplit(kv, progress=False)
        self._tok = ExLlamaV2Tokenizer(config)
        self._gen = ExLlamaV2DynamicGenerator(
            model=self._model,
            cache=kv,
            tokenizer=self._tok,
            max_batch_size=self.max_batch,
            max_seq_len=self.n_ctx,
            max_chunk_size=self._chunk,
            paged=paged,
        )

    def _load_vocabulary(self, config: Any, path: Path) -> None:
        self.n_vocab = int(config.vocab_size)
        generation_eos = (getattr(config, "generation_config", None) or {}).get("eos_token_id")
        self._stop_ids = stop_token_ids(self._tok.eos_token_id, generation_eos)
        self._add_bos = bool((self._tok.tokenizer_config_dict or {}).get("add_bos_token", False))
        self._ll = load_ll_tokenizer(path, self.n_vocab, self._stop_ids)

    # -- sequences --------------------------------------------------------------------------
    def _check(self, spec: SeqSpec) -> None:
        bad = unsupported(spec.params)
        if bad:
            raise ValueError(f"not supported by the exllamav2 engine: {', '.join(bad)}")
        logit_bias_pairs(spec.params.logit_bias, self.n_vocab)

    def _start(self, spec: SeqSpec) -> list[TokenEvent | PromptEvent]:
        p = spec.params
        entries = self._score_prompt(spec) if spec.prompt_logprobs is not None else None
        if spec.max_new_tokens == 0:  # prefill only: the scores are all that was asked for
            return [PromptEvent(spec.key, 0, entries), TokenEvent(spec.key, None, None, "length", t=time.monotonic())]
        grammar = None
        if spec.matcher is not None:
            grammar = grammar_filter_class()(self._model, self._tok, spec.matcher, self.n_vocab)
        job = make_job(spec, self._stop_ids, self._settings(spec), [grammar] if grammar is not None else None)
        self._gen.enqueue(job)
        state = SeqState(spec.key, p.needs_token_logprobs, p.logprobs or 0, entries, grammar=grammar)
        self._live[spec.key] = (job, state)
        return []

    def _settings(self, spec: SeqSpec) -> Any:
        """A fresh Settings per job: Mirostat's mu and DRY's n-gram trie live in it."""
        p = spec.params
        breakers = self._breaker_ids(p.dry_sequence_breakers) if p.dry_multiplier > 0 else None
        return gen_settings(p, self.n_vocab, self._gen.padded_vocab_size, breakers)

    def _score_prompt(self, spec: SeqSpec) -> list[tuple[float | None, int | None, Any]]:
        """Log-probability, rank and top-k of prompt tokens 1..n-1, from one cache-less forward pass
        (which exllamav2 limits to `max_input_len`, our chunk size)."""
        n = min(spec.prompt_logprobs_len or len(spec.prompt_ids), len(spec.prompt_ids))
        if n > self._chunk:
            raise ValueError(
                f"prompt scoring (echo with logprobs, prompt_logprobs) covers at most {self._chunk} prompt "
                f"tokens on this engine (SPOOL_EXL2_CHUNK_SIZE); this prompt has {n}"
            )
        torch, k = self._torch, spec.prompt_logprobs or 0
        lps: list[float] = []
        ranks: list[int] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        if n < 2:
            return prompt_entries(lps, ranks, top_ids, top_lps)
        ids = torch.tensor([spec.prompt_ids[:n]], dtype=torch.long)
        with torch.inference_mode():
            logits = self._model.forward(ids)  # (1, n, padded vocab) on the last layer's device
            rows = logits[0, :-1, : self.n_vocab]
            targets = ids[0, 1:].to(rows.device)
            for a in range(0, n - 1, SCORE_ROWS):
                logp = torch.log_softmax(rows[a : a + SCORE_ROWS].float(), dim=-1)
                lp = logp.gather(1, targets[a : a + SCORE_ROWS, None])
                lps += lp[:, 0].tolist()
                ranks += ((logp > lp).sum(dim=1) + 1).tolist()
                if k:
                    best = logp.topk(k, dim=-1)
                    top_ids += best.indices.tolist()
                    top_lps += best.values.tolist()
        return prompt_entries(lps, ranks, top_ids, top_lps)
