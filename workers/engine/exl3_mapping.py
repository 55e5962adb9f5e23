"""ExLlamaV3 without a GPU: GenerationParams and SeqSpec as exllamav3's `ComboSampler` and `Job`
arguments. Plain data in, plain data out, unit-tested in CI where neither torch nor exllamav3 is
installed; the adapter that drives `exllamav3.Generator` with them needs a CUDA machine (issue 15).

Names and semantics are those of exllamav3's `generator/sampler/presets.py: ComboSampler` (logit
bias, then repetition penalty, then presence/frequency penalties over the last `rep_sustain_range`
tokens, prompt included, which the engine narrows to the output (`output_window`), then min-p, top-k,
top-p, and the temperature last (`temp_last`: truncation before temperature, as llama.cpp and the
ExLlamaV2 engine do), sample; `temperature == 0` or `top_k == 1` is argmax) and `generator/job.py:
Job` (`max_new_tokens`, `min_new_tokens`, `seed`, `stop_conditions`, `return_logits`,
`identifier`). DRY is its `SS_DRY` step (1.6.5; breakers as token ids, range 0 =
the whole context). Its sampler has no typical-p or Mirostat: those are refused
at the edge (core/generation/capabilities.py), and asked again here so an adapter cannot ignore them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from core.generation import capabilities
from core.generation.params import GenerationParams
from workers.engine.base import SeqSpec

WHOLE_SEQUENCE = int(10e7)  # ComboSampler's default rep_sustain_range: every past token


class Unsupported(ValueError):
    pass


def sampler_args(p: GenerationParams, dry_breakers: frozenset[int] | None = None) -> dict[str, Any]:
    """Keyword arguments of `ComboSampler` for these parameters (every field set explicitly: its
    defaults are not OpenAI's, e.g. it has no notion of "unset"). `dry_breakers`: the breakers as
    token ids (exl2_mapping.dry_breaker_ids); None lets exllamav3 derive its default set."""
    refused = capabilities.unsupported("exllamav3", p)
    if refused:
        raise Unsupported(f"exllamav3 cannot honour {refused}")
    window = WHOLE_SEQUENCE if p.penalty_last_n is None else p.penalty_last_n
    off = window == 0  # llama.cpp's `repeat_last_n: 0`: penalties off (exllamav3 has no empty window)
    greedy = p.greedy
    return {
        "rep_p": 1.0 if off else p.repetition_penalty,
        "freq_p": 0.0 if off else p.frequency_penalty,
        "pres_p": 0.0 if off else p.presence_penalty,
        "rep_sustain_range": max(window, 1),
        "rep_decay_range": 0,
        "temperature": 0.0 if greedy else p.temperature,
        "min_p": p.min_p,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "temp_last": True,  # truncation (min-p, top-k, top-p) on the untempered row, as llama.cpp does
        "logit_bias": dict(p.logit_bias) or None,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_range": 0,
        "dry_sequence_breakers": dry_breakers if p.dry_multiplier > 0 else None,
    }


def output_window(p: GenerationParams) -> int:
    """How many of the latest *output* tokens presence and frequency penalties count: all of them
    unless `repeat_last_n` narrows it. ComboSampler's own range would reach into the prompt; the
    engine's sampler (exllamav3.sampler_class) cuts it to the output before every token."""
    return WHOLE_SEQUENCE if p.penalty_last_n is None else max(p.penalty_last_n, 0)


def job_args(spec: SeqSpec, eos_ids: Iterable[int], filters: list[Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of `exllamav3.Job`, except `input_ids` and `sampler` (torch objects)."""
    p = spec.params
    # The job blocks its stop tokens (-inf in its logit mask) until `min_new_tokens` exist; `ignore_eos`
    # is that block for the whole job, so no EOS is ever sampled (no stop conditions alone would let
    # the model emit EOS tokens and go on past them).
    min_new = spec.max_new_tokens if p.ignore_eos else min(max(p.min_tokens - spec.prior, 0), spec.max_new_tokens)
    return {
        "max_new_tokens": spec.max_new_tokens,
        "min_new_tokens": min_new,
        "seed": spec.seed % 2**31,  # torch generator seeds are 64-bit, exllamav3 stores them in 32
        "stop_conditions": sorted(set(eos_ids)),
        # Top logprobs are read from the returned logits (exl2_mapping.events_from_result), never from
        # the job's top tokens: asking for them only sorted the whole vocabulary every token.
        "return_top_tokens": 0,
        # Our logprobs are of the raw distribution; best_of > n ranks its candidates by them too.
        "return_logits": p.needs_token_logprobs,
        "identifier": spec.key,
        "filters": filters or [],
        "decode_special_tokens": False,
    }
