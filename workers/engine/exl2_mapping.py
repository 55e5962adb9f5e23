"""ExLlamaV2 without a GPU: the pure half of the GPU engine (workers/engine/exllamav2.py).

GenerationParams and SeqSpec become `ExLlamaV2Sampler.Settings` fields and `ExLlamaV2DynamicJob`
arguments; one `ExLlamaV2DynamicGenerator.iterate()` result becomes our engine events. Plain data in,
plain data out, so all of it is unit-tested in CI, where neither torch nor exllamav2 is installed.

Names and semantics are those of exllamav2 0.3.2 (`exllamav2/generator/sampler.py`, `.../dynamic.py`,
`exllamav2_ext/ext_sampling.cpp`); the facts this module leans on are quoted where they are used.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.generation import capabilities
from core.generation.params import GenerationParams
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent, TopList
from workers.engine.logits import log_softmax, top_logprobs

log = logging.getLogger(__name__)

EXLLAMAV2_VERSION = "0.3.2"
PAGE_SIZE = 256  # exllamav2's PAGED_PAGE_SIZE: cache and prefill chunks come in whole pages

# Every user-facing field of ExLlamaV2Sampler.Settings (0.3.2). The rest of the dataclass is sampler
# state (mirostat_mu aside: ngram_trie, ngram_index, ngram_history for DRY), left to its defaults by
# building a fresh Settings per job.
SETTINGS_FIELDS = (
    "token_repetition_penalty",
    "token_repetition_range",
    "token_repetition_decay",
    "token_frequency_penalty",
    "token_presence_penalty",
    "temperature",
    "smoothing_factor",
    "min_temp",
    "max_temp",
    "temp_exponent",
    "top_k",
    "top_p",
    "top_a",
    "min_p",
    "tfs",
    "typical",
    "skew",
    "temperature_last",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "mirostat_mu",
    "token_bias",
    "cfg_scale",
    "post_sampling_hooks",
    "dry_allowed_length",
    "dry_base",
    "dry_multiplier",
    "dry_sequence_breakers",
    "dry_range",
    "dry_max_ngram",
    "xtc_probability",
    "xtc_threshold",
    "xtc_ignore_tokens",
)

CACHE_CLASSES = {  # SPOOL_EXL2_CACHE_QUANT -> exllamav2 class (its ExLlamaV2Cache_8bit is refused by the
    "fp16": "ExLlamaV2Cache",  # dynamic generator; the Q8 cache is a different, supported class)
    "q4": "ExLlamaV2Cache_Q4",
    "q6": "ExLlamaV2Cache_Q6",
    "q8": "ExLlamaV2Cache_Q8",
}


# -- what this engine cannot do ---------------------------------------------------------------
def unsupported(p: GenerationParams) -> list[str]:
    """Parameters (by GenerationParams name) this engine cannot honour for these values.

    exllamav2 has one Mirostat, and it is 2.0: `mirostat_pre_cpu` keeps the tokens whose surprise is
    under mu and `mirostat_post_cpu` moves mu by eta; there is no v1 (Zipf-estimated k). The table
    itself lives in core/generation/capabilities.py so the API refuses these before anything is stored.
    """
    return capabilities.unsupported("exllamav2", p)


# -- sampler settings -------------------------------------------------------------------------
def _neutral() -> dict[str, Any]:
    """Every sampler off. Settings' own defaults are not neutral (repetition penalty 1.025, top-k 50,
    top-p 0.8, temperature 0.8), so nothing may be left to them."""
    return {
        "token_repetition_penalty": 1.0,
        "token_repetition_range": -1,  # -1: the whole sequence, prompt included (llama.cpp: last n_ctx)
        "token_repetition_decay": 0,
        "token_frequency_penalty": 0.0,
        "token_presence_penalty": 0.0,
        "temperature": 1.0,
        "smoothing_factor": 0.0,
        "min_temp": 0.0,
        "max_temp": 0.0,  # dynamic temperature only runs when max_temp > min_temp
        "temp_exponent": 1.0,
        "top_k": 0,  # 0 = off
        "top_p": 1.0,  # applied only when 0 < top_p < 1
        "top_a": 0.0,
        "min_p": 0.0,  # applied only when 0 < min_p < 1
        "tfs": 0.0,
        "typical": 0.0,  # applied only when 0 < typical < 1
        "skew": 0.0,
        "temperature_last": False,
        "mirostat": False,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "mirostat_mu": None,  # the sampler starts it at 2 * tau, as llama.cpp's Mirostat 2.0 does
        "token_bias": None,
        "cfg_scale": None,
        "post_sampling_hooks": [],
        "dry_allowed_length": 2,
        "dry_base": 1.75,
        "dry_multiplier": 0.0,  # 0 = DRY off
        "dry_sequence_breakers": None,
        "dry_range": 0,  # 0 = the whole sequence (llama.cpp: last n_ctx, the same here)
        "dry_max_ngram": 20,
        "xtc_probability": 0.0,  # 0 = XTC off
        "xtc_threshold": 0.1,
        "xtc_ignore_tokens": None,
    }


def sampler_settings(p: GenerationParams, dry_breakers: frozenset[int] | None = None) -> dict[str, Any]:
    """GenerationParams -> keyword arguments of `ExLlamaV2Sampler.Settings`, every field explicit.

    Two values are left for the engine to materialise, as they need the model: `token_bias` is a
    {token id: bias} dict here (a padded-vocabulary float tensor there), and `dry_sequence_breakers`
    comes in as token ids (`dry_breaker_ids`). The seed is the job's, not the sampler's.

    exllamav2 runs, in this order: penalties, token_bias, DRY, grammar mask, softmax (at
    `temperature` unless `temperature_last`), top-k, top-p, top-a, min-p, TFS, typical, Mirostat,
    then the temperature if `temperature_last`. llama-server truncates before the temperature, so
    that is what `temperature_last` reproduces; Mirostat 2.0 follows the temperature in both.
    """
    s = _neutral()
    s.update(
        token_repetition_penalty=p.repetition_penalty,
        # Presence and frequency are not the sampler's: its one penalty pass spans the prompt too (a
        # single range for all three). The job applies them over the output only (`output_penalties`).
        token_frequency_penalty=0.0,
        token_presence_penalty=0.0,
        token_bias=dict(sorted(p.logit_bias.items())) or None,  # added to the logits, like OpenAI's
        mirostat_tau=p.mirostat_tau,
        mirostat_eta=p.mirostat_eta,
    )
    if p.dry_multiplier > 0:
        s.update(
            dry_multiplier=p.dry_multiplier,
            dry_base=p.dry_base,
            dry_allowed_length=p.dry_allowed_length,
            dry_sequence_breakers=dry_breakers,
        )
    if p.greedy:
        # Greedy as `Settings.greedy()` does it: top-k 1 on the untempered row (the C++ sampler also
        # turns any temperature under 0.01 into top-k 1). Penalties, bias and DRY still apply first.
        s.update(temperature=1.0, top_k=1)
        return s
    if p.mirostat:
        s.update(temperature=p.temperature, mirostat=True)  # llama.cpp: temperature, then Mirostat 2.0
        return s
    # llama.cpp keeps the single best token for top_p = 0 and for min_p = 1; exllamav2 reads both as
    # "off", so say what is meant.
    top_k = 1 if p.top_p <= 0 or p.min_p >= 1 else p.top_k
    s.update(
        temperature=p.temperature,
        temperature_last=True,
        top_k=top_k,
        top_p=p.top_p if 0 < p.top_p < 1 else 1.0,
        min_p=p.min_p if p.min_p < 1 else 0.0,
        typical=p.typical_p if p.typical_p < 1 else 0.0,
    )
    return s


def output_penalties(p: GenerationParams) -> tuple[float, float]:
    """(presence, frequency) as OpenAI defines them, over the tokens generated so far only (llama.cpp's
    engine and TabbyAPI count the output alone): the engine's job subtracts `frequency x count +
    presence x [count > 0]` per token, before the library's sampler (repetition penalty over prompt
    and output, bias, DRY, ...) sees the row. exllamav2's own pass would count the prompt too."""
    return p.presence_penalty, p.frequency_penalty


def dry_breaker_ids(breakers: Iterable[str], pieces: Sequence[str]) -> frozenset[int]:
    """DRY sequence breakers as exllamav2 takes them: token ids, not strings. A token breaks a
    sequence when its text contains a breaker (exllamav2 derives its default set the same way).
    llama.cpp also matches a breaker split across tokens; a per-token set cannot."""
    wanted = [b for b in breakers if b]
    return frozenset(i for i, piece in enumerate(pieces) if any(b in piece for b in wanted))


def logit_bias_pairs(bias: Mapping[int, float] | None, n_vocab: int) -> list[tuple[int, float]]:
    """The (token, bias) pairs for the token_bias tensor; an id outside the vocabulary is an error."""
    pairs = sorted((bias or {}).items())
    bad = [t for t, _ in pairs if not 0 <= t < n_vocab]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is out of range 0..{n_vocab - 1}")
    return pairs


# -- job arguments ----------------------------------------------------------------------------
def job_arguments(spec: SeqSpec, stop_ids: Iterable[int]) -> dict[str, Any]:
    """SeqSpec -> keyword arguments of `ExLlamaV2DynamicJob` (all but input_ids, gen_settings and
    filters, which need torch or the model).

    - A job has no stop tokens unless given (`stop_conditions=None` means none, not EOS).
    - `min_new_tokens`: until that many tokens exist the job's stop tokens are blocked (logit -1e30).
      `ignore_eos` is the same block for the whole job. A grammar that allows only EOS still gets it
      through (-1e30 is the only finite logit left).
    - Stop strings are left to the worker (workers/engine/text.py), as with llama.cpp.
    - Log-probabilities come from the returned logits (`return_logits`): `top_k_probs` are the final
      sampling probabilities (after truncation and temperature), not the model's distribution.
    """
    p = spec.params
    if p.ignore_eos:
        min_new = spec.max_new_tokens
    else:
        min_new = min(max(p.min_tokens - spec.prior, 0), spec.max_new_tokens)
    return {
        "max_new_tokens": spec.max_new_tokens,
        "min_new_tokens": min_new,
        "seed": spec.seed,  # the job's random.Random; one draw per sampled token
        "stop_conditions": sorted(set(stop_ids)),
        "decode_special_tokens": False,  # text is not used: the worker decodes token bytes itself
        "return_top_tokens": 0,
        "return_logits": p.needs_token_logprobs,
        "return_probs": False,
        "token_healing": False,  # it would rewrite the prompt's last token
        "banned_strings": None,  # cannot be combined with filters (the grammar)
        "filter_prefer_eos": False,
        "identifier": spec.key,  # comes back in every result
    }


def stop_token_ids(eos_id: int | None, generation_eos: Iterable[int] | None) -> list[int]:
    """The tokens that end a sequence: the tokenizer's EOS plus generation_config.json's list
    (exllamav2's config keeps only the first of a list in `eos_token_id`)."""
    ids = {int(t) for t in (generation_eos or []) if t is not None}
    if eos_id is not None:
        ids.add(int(eos_id))
    return sorted(ids)


# -- sizes ------------------------------------------------------------------------------------
def round_up(n: int, multiple: int = PAGE_SIZE) -> int:
    return -(-n // multiple) * multiple


def cache_tokens(n_ctx: int, max_batch: int, requested: int | None, paged: bool) -> int:
    """KV-cache size in tokens: a whole number of pages, at least one full-length sequence. Unpaged,
    the cache is that one sequence (exllamav2's unpaged mode runs one job at a time)."""
    one = round_up(n_ctx)
    if not paged:
        return one
    return max(round_up(requested if requested else n_ctx * max_batch), one)


def chunk_size(requested: int) -> int:
    """Prefill chunk: a positive multiple of the page size (exllamav2 asserts it in paged mode)."""
    if requested < PAGE_SIZE or requested % PAGE_SIZE:
        raise ValueError(f"exl2 chunk size must be a positive multiple of {PAGE_SIZE}, not {requested}")
    return requested


# -- results -> events ------------------------------------------------------------------------
@dataclass
class SeqState:
    """What the engine keeps per live job to turn its results into events."""

    key: Hashable
    want_logprobs: bool = False
    top_k: int = 0  # alternatives per token (OpenAI's `logprobs`)
    prompt_entries: list[tuple[float | None, int | None, TopList | None]] | None = None
    prompt_sent: bool = False
    grammar: Any = None  # the job's grammar filter: its `error` ends the sequence with an error


def cached_tokens(job: Any) -> int:
    """Prompt tokens a job found in the cache: whole pages reused (`cached_pages`) plus a partial
    page copied from a matching one (`cached_tokens`), as its final result reports them."""
    page = getattr(getattr(job, "generator", None), "page_size", PAGE_SIZE)
    return int(getattr(job, "cached_pages", 0)) * page + int(getattr(job, "cached_tokens", 0))


FINISH = {"max_new_tokens": "length", "stop_token": "stop", "end_filter": "stop", "stop_string": "stop"}


def finish_reason(result: Mapping[str, Any], state: SeqState) -> tuple[str | None, str | None]:
    """(finish reason, error): the filter forces EOS after a token the grammar rejected, which is an
    error of the sequence, not a stop."""
    if not result.get("eos"):
        return None, None
    error = getattr(state.grammar, "error", None)
    if error:
        return None, f"grammar: {error}"
    return FINISH.get(result.get("eos_reason", ""), "stop"), None


def _tokens_and_logits(result: Mapping[str, Any]) -> tuple[list[int], np.ndarray | None, tuple[int, Any] | None]:
    """The tokens a result releases, and their logits rows when the job returns logits.

    A stop token is not released: its result carries, under "held", the tokens held back so far
    (text waiting for a complete UTF-8 character) followed by the stop token itself, returned apart
    as (id, logits row or None) so its logprob is still reported.
    """
    src: Mapping[str, Any] = result
    drop_last = False
    if result.get("eos_reason") == "stop_token":
        src, drop_last = result.get("held") or {}, True
    raw_ids = src.get("token_ids")
    ids = [] if raw_ids is None else np.asarray(raw_ids).reshape(-1).astype(int).tolist()
    raw_logits = src.get("logits")
    logits = None
    if raw_logits is not None:
        arr = np.asarray(raw_logits, dtype=np.float32)
        logits = arr.reshape(-1, arr.shape[-1])
    eos = None
    if drop_last and ids:
        eos = (ids[-1], logits[len(ids) - 1] if logits is not None and len(logits) >= len(ids) else None)
        ids = ids[:-1]
        logits = logits[: len(ids)] if logits is not None else None
    return ids, logits, eos


def result_key(result: Mapping[str, Any]) -> Hashable:
    """The sequence a result belongs to: its `identifier`, or the identifier of its `job` (exllamav3's
    error results, `Generator.reap_failed_job`, carry only the job)."""
    key = result.get("identifier")
    if key is None:
        key = getattr(result.get("job"), "identifier", None)
    return key


def failure_text(error: Any) -> str:
    """What the client is told when the library failed one sequence: the library's own words."""
    if isinstance(error, BaseException):
        return f"engine error: {type(error).__name__}: {error}"
    return f"engine error: {error}" if error else "engine error"


def events_from_result(
    result: Mapping[str, Any], states: Mapping[Hashable, SeqState], *, n_vocab: int, now: float = 0.0
) -> list[TokenEvent | PromptEvent]:
    """One `iterate()` result -> our events. "started" and "prefill" results say nothing to us; the
    first "streaming" one means the prompt is in the cache (PromptEvent), then one TokenEvent per
    released token, the last carrying the finish reason (or a token-less TokenEvent carries it)."""
    key = result_key(result)
    state = states.get(key) if key is not None else None
    if state is None:
        return []
    if result.get("stage") == "error":  # exllamav3: its prefill or page allocation raised
        return [TokenEvent.failed(key, failure_text(result.get("error")), now)]
    if result.get("stage") != "streaming":
        return []
    out: list[TokenEvent | PromptEvent] = []
    if not state.prompt_sent:
        state.prompt_sent = True
        out.append(PromptEvent(key, cached_tokens(result.get("job")), state.prompt_entries))
    ids, logits, eos = _tokens_and_logits(result)
    finish, error = finish_reason(result, state)

    def scored(tok: int, row: Any) -> tuple[float | None, TopList | None]:
        if not state.want_logprobs or row is None:
            return None, None
        logp = log_softmax(row[:n_vocab])  # the padded head's extra columns are not tokens
        return float(logp[tok]), (top_logprobs(logp, state.top_k) if state.top_k else None)

    for i, tok in enumerate(ids):
        lp, top = scored(tok, logits[i] if logits is not None and i < len(logits) else None)
        last = i == len(ids) - 1 and eos is None
        out.append(TokenEvent(key, tok, lp, finish if last else None, top, now, error=error if last else None))
    if eos is not None:  # the stop token: no text, but its logprob (as the CPU engine reports it)
        lp, top = scored(eos[0], eos[1])
        out.append(TokenEvent(key, None, lp, finish, top, now, error=error, eos_id=eos[0]))
    elif (finish or error) and not ids:
        out.append(TokenEvent(key, None, None, finish, t=now, error=error))
    return out


def collect(results: list[Any], live: dict[Hashable, tuple[Any, SeqState]], gen: Any, n_vocab: int) -> list[Any]:
    """One `iterate()`'s results as events, and the sequences that ended taken out of `live`. A job
    the library failed (an "error" result: prefill or page allocation raised; it carries the job but
    no identifier) or that failed in our job class (`spool_error`: sampling, its constraint) ends
    alone with the library's message; the other jobs of the batch step on."""
    now = time.monotonic()
    states = {key: state for key, (_, state) in live.items()}
    out: list[Any] = []
    for result in results:
        out.extend(events_from_result(result, states, n_vocab=n_vocab, now=now))
        if result.get("eos"):
            live.pop(result_key(result), None)
    for key, (job, _) in list(live.items()):
        error = getattr(job, "spool_error", None)
        if error:
            del live[key]
            try:
                gen.cancel(job)  # already out of the generator when it ended as an EOS: a no-op then
            except Exception:
                log.exception("the generator could not cancel %s", key)
            out.append(TokenEvent.failed(key, error, now))
    return out


def prompt_entries(
    logprobs: Sequence[float],
    ranks: Sequence[int],
    top_ids: Sequence[Sequence[int]],
    top_lps: Sequence[Sequence[float]],
) -> list[tuple[float | None, int | None, TopList | None]]:
    """Scores of prompt tokens 1..n-1 (from one forward pass) -> PromptEvent entries; the first
    prompt token has nothing predicting it. With no alternatives asked for, `top` is []."""
    entries: list[tuple[float | None, int | None, TopList | None]] = [(None, None, None)]
    for i, lp in enumerate(logprobs):
        ids = top_ids[i] if i < len(top_ids) else []
        lps = top_lps[i] if i < len(top_lps) else []
        top = [(int(t), float(v)) for t, v in zip(ids, lps, strict=True) if math.isfinite(v)]
        entries.append((float(lp), int(ranks[i]), top))
    return entries
