"""ExLlamaV2Engine on a real GPU, with a tiny random-weight Llama (tests/gpu/conftest.py): what this
engine does beyond what both engines promise (test_exllama_engines.py). Random weights make the text
meaningless but the mechanics checkable: the pinned library's settings and job arguments, SmolLM2's
token ids, prompt scores, min_tokens, held partial characters, grammar ends, every sampler, priority.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from core.generation.params import GenerationParams
from tests.gpu.drive import finish, run, spec, tokens
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.exl2_mapping import SETTINGS_FIELDS, sampler_settings

pytestmark = pytest.mark.gpu


@pytest.fixture
def engine(exllamav2_engine: Any) -> Any:
    return exllamav2_engine


def test_settings_fields_match_the_installed_exllamav2(cuda):
    import exllamav2
    from exllamav2.generator import ExLlamaV2Sampler

    state = {"ngram_trie", "ngram_index", "ngram_history"}  # DRY's working state, not settings
    fields = {f.name for f in dataclasses.fields(ExLlamaV2Sampler.Settings)} - state
    assert fields == set(SETTINGS_FIELDS), exllamav2.__version__
    ExLlamaV2Sampler.Settings(**sampler_settings(GenerationParams(mirostat=2)))


def test_job_arguments_are_real_job_parameters(cuda):
    # ExLlamaV2DynamicJob takes **kwargs, so a misspelt argument would be dropped silently.
    import inspect

    from exllamav2.generator import ExLlamaV2DynamicJob

    from workers.engine.exl2_mapping import job_arguments

    known = set(inspect.signature(ExLlamaV2DynamicJob.__init__).parameters)
    s = SeqSpec(key="k", prompt_ids=[1], max_new_tokens=1, params=GenerationParams(), seed=0)
    assert set(job_arguments(s, [2])) <= known


def test_tokenizer(engine):
    ids = engine.tokenize("Hello world")
    assert ids == [19556, 905]  # SmolLM2's ids, as llama.cpp tokenizes the GGUF
    assert b"".join(engine.token_bytes(t) for t in ids) == b"Hello world"
    assert engine.tokenize("<|im_start|>") == [1]
    assert engine.token_bytes(2) == b"" and engine.token_text(2) == "<|im_end|>"


def test_logprobs_and_prompt_scores(engine):
    s = spec(engine, "lp", 6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    out = run(engine, [s])["lp"]
    prompt = [e for e in out if isinstance(e, PromptEvent)]
    assert len(prompt) == 1 and len(prompt[0].entries) == len(s.prompt_ids)
    assert prompt[0].entries[0] == (None, None, None)
    for lp, rank, top in prompt[0].entries[1:]:
        assert lp <= 0 and rank >= 1 and len(top) == 2
    for ev in (e for e in out if isinstance(e, TokenEvent) and e.token_id is not None):
        assert ev.logprob <= 0 and len(ev.top) == 2
        assert ev.top[0][0] == ev.token_id  # greedy without penalties picks the most likely token


def test_prefill_only_returns_prompt_scores(engine):
    out = run(engine, [spec(engine, "p0", 0, prompt_logprobs=0)])["p0"]
    assert isinstance(out[0], PromptEvent) and len(out[0].entries) > 1
    assert finish(out) == "length" and tokens(out) == []


def test_prefix_pages_are_reused(engine):
    if engine.max_batch == 1:
        pytest.skip("unpaged (no flash-attn): only the last sequence's cache is compared")
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)  # > 2 pages of 256 tokens
    first = run(engine, [spec(engine, "c1", 2, prompt=long, temperature=0)])["c1"]
    second = run(engine, [spec(engine, "c2", 2, prompt=long, temperature=0)])["c2"]
    assert first[0].cached == 0 or first[0].cached < second[0].cached
    assert second[0].cached >= 512


def test_min_tokens_hold_eos_back_then_eos_stops_unreleased(engine):
    # EOS (2) is the best token by far, but blocked for the first 3; the filler token is a lone
    # UTF-8 continuation byte, so the generator also holds those tokens back until the end.
    filler = 241
    s = spec(engine, "eos", 20, temperature=0, min_tokens=3, logit_bias={filler: 100.0, 2: 200.0})
    out = run(engine, [s])["eos"]
    assert tokens(out) == [filler] * 3 and finish(out) == "stop"
    with_lp = run(engine, [dataclasses.replace(s, key="eos-lp", params=dataclasses.replace(s.params, logprobs=2))])
    last = with_lp["eos-lp"][-1]
    assert last.eos_id == 2 and last.logprob is not None  # the stop token's logprob is reported


def test_held_partial_characters_are_all_delivered(engine):
    out = run(engine, [spec(engine, "utf", 12, temperature=0, ignore_eos=True, logit_bias={241: 100.0})])["utf"]
    assert tokens(out) == [241] * 12 and finish(out) == "length"


def test_grammar_ends_even_with_ignore_eos(engine):
    from llguidance import LLMatcher

    matcher = LLMatcher(engine.ll_tokenizer(), LLMatcher.grammar_from_regex(r"[a-c]{4}"), log_level=0)
    s = dataclasses.replace(spec(engine, "ge", 30, temperature=1.0, ignore_eos=True), matcher=matcher)
    out = run(engine, [s])["ge"]
    assert re.fullmatch(r"[a-c]{4}", b"".join(engine.token_bytes(t) for t in tokens(out)).decode())
    assert finish(out) == "stop"


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 40, "top_p": 0.9, "min_p": 0.05, "typical_p": 0.9, "temperature": 0.8},
        {"mirostat": 2, "mirostat_tau": 3.0},
        {"dry_multiplier": 0.8, "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5},
        {"top_p": 0.0},
    ],
)
def test_samplers_run(engine, params):
    out = run(engine, [spec(engine, "smp", 24, ignore_eos=True, **params)])["smp"]
    assert len(tokens(out)) == 24 and finish(out) == "length"


def test_interactive_sequences_start_first(engine):
    batch = [dataclasses.replace(spec(engine, f"b{i}", 4, ignore_eos=True), interactive=False) for i in range(6)]
    urgent = spec(engine, "urgent", 4, ignore_eos=True)
    out = run(engine, [*batch, urgent])
    order = []
    for key, events in out.items():
        order.append((min(e.t for e in events if isinstance(e, TokenEvent)), key))
    started = [key for _, key in sorted(order)]
    assert started.index("urgent") < started.index("b5")


def test_a_sequence_that_cannot_start_fails_alone(engine):
    too_long = " ".join(["word"] * 400)  # more prompt tokens than one cache-less scoring pass takes
    bad = spec(engine, "bad", 2, prompt=too_long, prompt_logprobs=1)
    good = spec(engine, "good", 3, ignore_eos=True)
    out = run(engine, [bad, good])
    assert out["bad"][-1].error and len(tokens(out["good"])) == 3
