"""GenerationParams -> exllamav3's ComboSampler and Job arguments (pure; no torch, no GPU)."""

from __future__ import annotations

import pytest

from core.generation import capabilities
from ops.factories import params
from workers.engine.base import SeqSpec
from workers.engine.exl3_mapping import WHOLE_SEQUENCE, Unsupported, job_args, sampler_args


def test_every_sampler_field_is_set_explicitly():
    args = sampler_args(params(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: -100.0}))  # fmt: skip
    assert args == {
        "rep_p": 1.1, "freq_p": 0.25, "pres_p": 0.5, "rep_sustain_range": WHOLE_SEQUENCE, "rep_decay_range": 0,
        "temperature": 0.7, "min_p": 0.05, "top_k": 40, "top_p": 0.9, "temp_last": True, "logit_bias": {7: -100.0},
        "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_range": 0, "dry_sequence_breakers": None,
    }  # fmt: skip


def test_windows_greedy_and_penalties_off():
    assert sampler_args(params(penalty_last_n=64))["rep_sustain_range"] == 64
    off = sampler_args(params(penalty_last_n=0, repetition_penalty=1.3, presence_penalty=1.0))
    assert (off["rep_p"], off["pres_p"], off["freq_p"]) == (1.0, 0.0, 0.0)
    assert sampler_args(params(temperature=0.0))["temperature"] == 0.0  # ComboSampler's argmax path
    assert sampler_args(params())["logit_bias"] is None


@pytest.mark.parametrize(
    ("kw", "name"),
    [({"typical_p": 0.9}, "typical_p"), ({"mirostat": 2}, "mirostat")],
)
def test_what_exllamav3_lacks_is_refused_at_the_edge_and_here(kw, name):
    assert capabilities.unsupported("exllamav3", params(**kw)) == [name]
    with pytest.raises(Unsupported):
        sampler_args(params(**kw))


def test_dry_is_passed_with_breakers_as_token_ids():
    """exllamav3 1.6.5's ComboSampler has DRY (SS_DRY): mapped, not refused."""
    args = sampler_args(params(temperature=1.0, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3), frozenset({5}))
    assert capabilities.unsupported("exllamav3", params(dry_multiplier=0.8)) == []
    assert (args["dry_multiplier"], args["dry_base"], args["dry_allowed_length"]) == (0.8, 2.0, 3)
    assert args["dry_sequence_breakers"] == frozenset({5}) and args["dry_range"] == 0


def test_job_arguments():
    spec = SeqSpec(key=("j", 1, 0), prompt_ids=[1, 2, 3, 4], max_new_tokens=10, params=params(min_tokens=5, logprobs=2),
                   seed=2**40 + 5, prior=2)  # fmt: skip
    args = job_args(spec, eos_ids=[2, 0, 2])
    assert args["max_new_tokens"] == 10 and args["min_new_tokens"] == 3  # two were made by an earlier attempt
    assert args["stop_conditions"] == [0, 2] and args["return_top_tokens"] == 0 and args["return_logits"] is True
    assert args["seed"] == (2**40 + 5) % 2**31 and args["identifier"] == ("j", 1, 0)
    assert job_args(SeqSpec("k", [1], 4, params(best_of=3), 1), eos_ids=[2])["return_logits"] is True  # ranks by them


def test_ignore_eos_blocks_the_eos_tokens_for_the_whole_job():
    """No stop condition alone let the model sample EOS and go on past it: the job's own block of its
    stop tokens (min_new_tokens, -inf in its mask) holds for every token instead."""
    ignore = SeqSpec(key="k", prompt_ids=[1], max_new_tokens=7, params=params(ignore_eos=True, min_tokens=2), seed=1)
    args = job_args(ignore, eos_ids=[2, 5])
    assert args["stop_conditions"] == [2, 5] and args["min_new_tokens"] == 7


def test_prompt_scores_are_refused_before_the_job_is_stored():
    assert capabilities.unsupported("exllamav3", params(prompt_logprobs=2)) == ["prompt_logprobs"]
    assert capabilities.unsupported("exllamav3", params(echo=True, logprobs=1)) == ["echo"]
    assert capabilities.unsupported("exllamav3", params(echo=True)) == []
    assert capabilities.unsupported("exllamav2", params(prompt_logprobs=2)) == []
