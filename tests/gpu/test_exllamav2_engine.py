"""ExLlamaV2Engine on a real GPU, with a tiny random-weight Llama (tests/gpu/conftest.py).

Random weights make the text meaningless but the mechanics checkable: lengths, determinism,
cancellation, grammar masks, logit bias, logprobs, prompt scores and prefix reuse.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Hashable
from typing import Any

import pytest

from core.generation.params import GenerationParams
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.exl2_mapping import SETTINGS_FIELDS, sampler_settings

pytestmark = pytest.mark.gpu

PROMPT = "Once upon a time, in a land far away, there lived"


def spec(engine: Any, key: Hashable, n: int, prompt: str = PROMPT, scope: Any = None, **params: Any) -> SeqSpec:
    p = GenerationParams(**{"seed": 7, **params})
    ids = engine.tokenize(prompt)
    extra = {}
    if p.prompt_logprobs is not None:
        extra = {"prompt_logprobs": p.prompt_logprobs, "prompt_logprobs_len": len(ids)}
    return SeqSpec(key=key, prompt_ids=ids, max_new_tokens=n, params=p, seed=p.seed, cache_scope=scope, **extra)


def run(engine: Any, specs: list[SeqSpec], max_steps: int = 5000) -> dict[Hashable, list]:
    for s in specs:
        engine.add(s)
    out: dict[Hashable, list] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for ev in engine.step():
            out[ev.key].append(ev)
    raise AssertionError("engine did not finish")


def tokens(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id is not None]


def finish(events: list) -> str | None:
    return next((e.finish_reason for e in events if isinstance(e, TokenEvent) and e.finish_reason), None)


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


def test_greedy_generates_max_new_tokens(engine):
    out = run(engine, [spec(engine, "g", 24, temperature=0, ignore_eos=True)])["g"]
    assert isinstance(out[0], PromptEvent)
    assert len(tokens(out)) == 24 and finish(out) == "length"
    again = run(engine, [spec(engine, "g2", 24, temperature=0, ignore_eos=True)])["g2"]
    assert tokens(again) == tokens(out)


def test_same_seed_same_tokens(engine):
    a = run(engine, [spec(engine, "a", 32, temperature=1.0, ignore_eos=True, seed=11)])["a"]
    b = run(engine, [spec(engine, "b", 32, temperature=1.0, ignore_eos=True, seed=11)])["b"]
    assert tokens(a) == tokens(b) and len(tokens(a)) == 32


def test_batch_runs_together(engine):
    specs = [spec(engine, f"s{i}", 16, temperature=1.0, ignore_eos=True, seed=i) for i in range(4)]
    out = run(engine, specs)
    assert all(len(tokens(out[s.key])) == 16 and finish(out[s.key]) == "length" for s in specs)


def test_cancel_stops_a_sequence_and_spares_the_others(engine):
    engine.add(spec(engine, "keep", 40, temperature=0, ignore_eos=True))
    engine.add(spec(engine, "drop", 400, temperature=0, ignore_eos=True))
    seen: dict[str, list] = defaultdict(list)
    while len(tokens(seen["drop"])) < 3:
        for ev in engine.step():
            seen[ev.key].append(ev)
    engine.cancel("drop")
    after = run(engine, [])
    assert "drop" not in after
    assert len(tokens(seen["keep"] + after["keep"])) == 40
    assert not engine.has_work()


def test_regex_constraint_holds(engine):
    from llguidance import LLMatcher

    pattern = r"[0-9]{3}-[a-z]{2}"
    matcher = LLMatcher(engine.ll_tokenizer(), LLMatcher.grammar_from_regex(pattern), log_level=0)
    s = dataclasses.replace(spec(engine, "re", 30, temperature=1.0), matcher=matcher)
    out = run(engine, [s])["re"]
    text = b"".join(engine.token_bytes(t) for t in tokens(out)).decode()
    assert re.fullmatch(pattern, text), text
    assert finish(out) == "stop"


def test_logit_bias_wins_greedy(engine):
    target = engine.tokenize(" banana")[0]
    out = run(engine, [spec(engine, "lb", 8, temperature=0, ignore_eos=True, logit_bias={target: 100.0})])["lb"]
    assert tokens(out) == [target] * 8


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


def test_prefix_reuse_within_a_tenant_never_across(engine):
    """Paged (flash-attn) or not, a tenant's cached prompt serves that tenant only, and the PromptEvent's
    `cached` (the usage's cached_tokens) says so. CI runs the same on the library's own generator with
    CUDA stubbed (tests/unit/test_gpu_promises.py); this is the real cache."""
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)  # > 2 pages of 256 tokens
    a1 = run(engine, [spec(engine, "a1", 2, prompt=long, scope="tenant-a", temperature=0)])["a1"]
    a2 = run(engine, [spec(engine, "a2", 2, prompt=long, scope="tenant-a", temperature=0)])["a2"]
    b1 = run(engine, [spec(engine, "b1", 2, prompt=long, scope="tenant-b", temperature=0)])["b1"]
    assert isinstance(a1[0], PromptEvent) and a1[0].cached == 0
    assert a2[0].cached >= 512 and b1[0].cached == 0


def test_presence_and_frequency_leave_the_prompt_alone(engine):
    prompt = "The cat. " * 60 + "The"
    plain = run(engine, [spec(engine, "pp", 1, prompt=prompt, temperature=0, ignore_eos=True)])["pp"]
    pen = spec(
        engine, "pq", 1, prompt=prompt, temperature=0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert tokens(run(engine, [pen])["pq"]) == tokens(plain)
