"""GenerationParams -> ExLlamaV2 settings and job arguments; iterate() results -> engine events.

Pure: neither torch nor exllamav2 is needed. Result dicts are shaped as exllamav2 0.3.2's
`ExLlamaV2DynamicJob.receive_sample` builds them (numpy stands in for its CPU tensors).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from core.generation.params import GenerationParams
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.exl2_mapping import (
    SETTINGS_FIELDS,
    SeqState,
    cache_tokens,
    cached_tokens,
    chunk_size,
    dry_breaker_ids,
    events_from_result,
    job_arguments,
    logit_bias_pairs,
    output_penalties,
    prompt_entries,
    sampler_settings,
    stop_token_ids,
    unsupported,
)
from workers.engine.logits import log_softmax

V = 8  # vocabulary of the fake results
KEY = ("job", 1, 0)


def settings(**kw) -> dict:
    return sampler_settings(GenerationParams(**kw))


def spec(max_new: int = 10, prior: int = 0, **kw) -> SeqSpec:
    return SeqSpec(KEY, [1, 2, 3], max_new, GenerationParams(**kw), seed=42, prior=prior)


# -- unsupported ------------------------------------------------------------------------------
def test_only_mirostat_1_is_unsupported():
    assert unsupported(GenerationParams()) == []
    assert unsupported(GenerationParams(mirostat=1)) == ["mirostat"]
    assert unsupported(GenerationParams(mirostat=2)) == []
    everything = GenerationParams(
        logit_bias={1: 5.0},
        min_tokens=3,
        ignore_eos=True,
        prompt_logprobs=2,
        logprobs=3,
        echo=True,
        typical_p=0.5,
        dry_multiplier=0.8,
        grammar="start: /[0-9]+/",
        cache_prompt=False,
    )
    assert unsupported(everything) == []


# -- sampler settings -------------------------------------------------------------------------
def test_every_settings_field_is_set_explicitly():
    for kw in ({}, {"temperature": 0}, {"mirostat": 2}, {"dry_multiplier": 1.0, "top_k": 5}):
        assert set(settings(**kw)) == set(SETTINGS_FIELDS), kw


def test_defaults_are_plain_sampling_not_exllamav2s_defaults():
    s = settings()
    # exllamav2's own defaults are repetition penalty 1.025, top-k 50, top-p 0.8, temperature 0.8.
    assert s["token_repetition_penalty"] == 1.0
    assert (s["top_k"], s["top_p"], s["min_p"], s["typical"], s["temperature"]) == (0, 1.0, 0.0, 0.0, 1.0)
    assert (s["top_a"], s["tfs"], s["xtc_probability"], s["smoothing_factor"], s["skew"]) == (0, 0, 0, 0, 0)
    assert s["max_temp"] <= s["min_temp"]  # dynamic temperature off
    assert s["mirostat"] is False and s["dry_multiplier"] == 0.0
    assert s["token_bias"] is None and s["cfg_scale"] is None and s["post_sampling_hooks"] == []
    assert s["temperature_last"] is True  # truncation before temperature, as llama-server orders it


def test_greedy_is_top_k_1_untempered_and_keeps_penalties_bias_dry():
    s = settings(temperature=0, top_p=0.5, min_p=0.1, typical_p=0.5, logit_bias={3: -100.0}, presence_penalty=1.0)
    assert (s["temperature"], s["top_k"], s["temperature_last"]) == (1.0, 1, False)
    assert (s["top_p"], s["min_p"], s["typical"]) == (1.0, 0.0, 0.0)
    assert s["token_bias"] == {3: -100.0}
    assert output_penalties(GenerationParams(temperature=0, presence_penalty=1.0)) == (1.0, 0.0)
    assert settings(temperature=0, dry_multiplier=0.5)["dry_multiplier"] == 0.5


def test_truncation_values_are_carried():
    s = settings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, typical_p=0.8)
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["typical"]) == (0.7, 40, 0.9, 0.05, 0.8)


def test_edge_values_exllamav2_reads_as_off_become_top_k_1():
    # llama.cpp keeps the single best token for top_p=0 and min_p=1; exllamav2 would switch them off.
    assert settings(top_p=0.0)["top_k"] == 1
    assert settings(min_p=1.0)["top_k"] == 1
    assert settings(min_p=1.0)["min_p"] == 0.0


def test_mirostat_2_replaces_truncation_and_follows_temperature():
    s = settings(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2, temperature=0.9, top_k=40, top_p=0.5)
    assert s["mirostat"] is True and (s["mirostat_tau"], s["mirostat_eta"]) == (3.0, 0.2)
    assert s["mirostat_mu"] is None  # the sampler starts it at 2 * tau
    assert (s["top_k"], s["top_p"], s["min_p"], s["typical"]) == (0, 1.0, 0.0, 0.0)
    assert (s["temperature"], s["temperature_last"]) == (0.9, False)


def test_penalties_and_dry():
    s = sampler_settings(
        GenerationParams(
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            dry_multiplier=2.0,
            dry_base=1.5,
            dry_allowed_length=3,
        ),
        frozenset({7, 9}),
    )
    # The sampler's one penalty pass spans the prompt: it keeps only the repetition penalty, and the
    # job applies presence and frequency over the output (tests/unit/test_gpu_promises.py).
    penalties = (s["token_repetition_penalty"], s["token_frequency_penalty"], s["token_presence_penalty"])
    assert penalties == (1.2, 0.0, 0.0)
    assert output_penalties(GenerationParams(frequency_penalty=0.5, presence_penalty=-0.5)) == (-0.5, 0.5)
    assert (s["token_repetition_range"], s["token_repetition_decay"]) == (-1, 0)  # whole sequence, no decay
    assert (s["dry_multiplier"], s["dry_base"], s["dry_allowed_length"]) == (2.0, 1.5, 3)
    assert s["dry_sequence_breakers"] == frozenset({7, 9}) and s["dry_range"] == 0


def test_logit_bias_is_sorted_and_validated():
    assert settings(logit_bias={5: 1.0, 2: -3.0})["token_bias"] == {2: -3.0, 5: 1.0}
    assert logit_bias_pairs({5: 1.0, 2: -3.0}, 10) == [(2, -3.0), (5, 1.0)]
    assert logit_bias_pairs(None, 10) == []
    with pytest.raises(ValueError, match="out of range"):
        logit_bias_pairs({10: 1.0}, 10)


def test_dry_breakers_are_tokens_containing_a_breaker():
    pieces = ["a", "\n", "b:", "c", '"x', "**", "", "ab"]
    assert dry_breaker_ids(("\n", ":", '"', "*"), pieces) == frozenset({1, 2, 4, 5})
    assert dry_breaker_ids(("ab",), pieces) == frozenset({7})
    assert dry_breaker_ids(("",), pieces) == frozenset()


# -- job arguments ----------------------------------------------------------------------------
def test_job_arguments_defaults():
    a = job_arguments(spec(), [2, 0, 2])
    assert a["max_new_tokens"] == 10 and a["min_new_tokens"] == 0
    assert a["seed"] == 42 and a["identifier"] == KEY
    assert a["stop_conditions"] == [0, 2]  # EOS must be given: a job has no stop tokens of its own
    assert a["return_logits"] is False and a["return_top_tokens"] == 0
    assert a["token_healing"] is False and a["banned_strings"] is None


def test_min_tokens_counts_earlier_attempts_and_ignore_eos_blocks_all():
    assert job_arguments(spec(min_tokens=5), [2])["min_new_tokens"] == 5
    assert job_arguments(spec(min_tokens=5, prior=3), [2])["min_new_tokens"] == 2
    assert job_arguments(spec(min_tokens=5, prior=9), [2])["min_new_tokens"] == 0
    assert job_arguments(spec(max_new=4, min_tokens=50), [2])["min_new_tokens"] == 4
    assert job_arguments(spec(max_new=7, ignore_eos=True), [2])["min_new_tokens"] == 7


def test_logits_are_returned_when_logprobs_or_best_of_need_them():
    assert job_arguments(spec(logprobs=0), [2])["return_logits"] is True
    assert job_arguments(spec(n=1, best_of=3), [2])["return_logits"] is True


def test_stop_token_ids():
    assert stop_token_ids(2, [2, 7]) == [2, 7]
    assert stop_token_ids(2, None) == [2]
    assert stop_token_ids(None, [5]) == [5]


# -- sizes ------------------------------------------------------------------------------------
def test_cache_and_chunk_sizes():
    assert cache_tokens(2048, 16, None, paged=True) == 32768
    assert cache_tokens(2000, 3, None, paged=True) == 6144  # rounded up to whole 256-token pages
    assert cache_tokens(2048, 16, 1000, paged=True) == 2048  # never less than one full sequence
    assert cache_tokens(2048, 16, 10000, paged=True) == 10240
    assert cache_tokens(3000, 16, 99999, paged=False) == 3072  # unpaged: one sequence's worth
    assert chunk_size(2048) == 2048
    for bad in (0, 100, 300):
        with pytest.raises(ValueError):
            chunk_size(bad)


# -- results -> events ------------------------------------------------------------------------
def job(cached_pages: int = 0, cached: int = 0) -> SimpleNamespace:
    return SimpleNamespace(cached_pages=cached_pages, cached_tokens=cached, generator=SimpleNamespace(page_size=256))


def streaming(ids: list[int], logits: np.ndarray | None = None, **kw) -> dict:
    r = {"job": job(), "stage": "streaming", "eos": False, "serial": 0, "identifier": KEY}
    if ids:
        r["token_ids"] = np.array([ids])
    if logits is not None:
        r["logits"] = logits[None]
    r.update(kw)
    return r


def states(**kw) -> dict:
    return {KEY: SeqState(KEY, **kw)}


def test_started_and_prefill_results_say_nothing():
    st = states()
    for stage in ("started", "prefill"):
        assert events_from_result({"stage": stage, "identifier": KEY, "eos": False}, st, n_vocab=V) == []
    assert st[KEY].prompt_sent is False


def test_unknown_identifier_is_ignored():
    assert events_from_result(streaming([3]) | {"identifier": "gone"}, states(), n_vocab=V) == []


def test_first_streaming_result_sends_the_prompt_event_once():
    st = states(prompt_entries=[(None, None, None), (-1.0, 2, [])])
    r = streaming([3]) | {"job": job(cached_pages=2, cached=17)}
    first = events_from_result(r, st, n_vocab=V, now=5.0)
    assert first[0] == PromptEvent(KEY, 2 * 256 + 17, [(None, None, None), (-1.0, 2, [])])
    assert first[1] == TokenEvent(KEY, 3, None, None, None, 5.0)
    again = events_from_result(streaming([4]), st, n_vocab=V)
    assert [type(e) for e in again] == [TokenEvent]


def test_held_tokens_come_out_together_finish_on_the_last():
    st = states(prompt_sent=True)
    evs = events_from_result(streaming([3, 4, 5], eos=True, eos_reason="max_new_tokens"), st, n_vocab=V)
    assert [(e.token_id, e.finish_reason) for e in evs] == [(3, None), (4, None), (5, "length")]


def test_stop_token_is_not_released_but_earlier_held_tokens_are():
    st = states(prompt_sent=True)
    r = streaming([], eos=True, eos_reason="stop_token", eos_triggering_token_id=2)
    r["held"] = {"token_ids": np.array([[6, 2]])}
    evs = events_from_result(r, st, n_vocab=V)
    # The stop token ends the sequence as a token-less event naming it (eos_id), as the CPU engine does.
    assert [(e.token_id, e.finish_reason, e.eos_id) for e in evs] == [(6, None, None), (None, "stop", 2)]
    bare = streaming([], eos=True, eos_reason="stop_token")
    bare["held"] = {"token_ids": np.array([[2]])}
    evs = events_from_result(bare, st, n_vocab=V)
    assert [(e.token_id, e.finish_reason, e.eos_id) for e in evs] == [(None, "stop", 2)]


def test_end_filter_is_stop_and_grammar_error_is_an_error():
    st = states(prompt_sent=True)
    evs = events_from_result(streaming([5], eos=True, eos_reason="end_filter"), st, n_vocab=V)
    assert evs[-1].finish_reason == "stop"
    st[KEY].grammar = SimpleNamespace(error="byte 'H' fails parse")
    r = streaming([], eos=True, eos_reason="stop_token")
    r["held"] = {"token_ids": np.array([[2]])}
    assert events_from_result(r, st, n_vocab=V)[-1].error == "grammar: byte 'H' fails parse"


def test_logprobs_come_from_the_returned_logits_without_head_padding():
    rows = np.random.default_rng(0).normal(size=(2, V + 4)).astype(np.float32)
    rows[:, V:] = 50.0  # padded head columns: not tokens, must not count
    st = states(prompt_sent=True, want_logprobs=True, top_k=3)
    evs = events_from_result(streaming([1, 6], rows), st, n_vocab=V)
    for ev, row in zip(evs, rows, strict=True):
        logp = log_softmax(row[:V])
        assert ev.logprob == pytest.approx(float(logp[ev.token_id]))
        best = np.argsort(-logp)[:3]
        assert [t for t, _ in ev.top] == best.tolist()
        assert [lp for _, lp in ev.top] == pytest.approx(logp[best].tolist())


def test_logprobs_without_alternatives_and_for_a_stop_tokens_held_rows():
    rows = np.zeros((2, V), dtype=np.float32)
    rows[1, 2] = 3.0  # the stop token's own row: its logprob is reported, not dropped
    st = states(prompt_sent=True, want_logprobs=True, top_k=0)
    r = streaming([], eos=True, eos_reason="stop_token")
    r["held"] = {"token_ids": np.array([[4, 2]]), "logits": rows[None]}
    ev, stop = events_from_result(r, st, n_vocab=V)
    assert (ev.token_id, ev.top, ev.finish_reason) == (4, None, None)
    assert ev.logprob == pytest.approx(-np.log(V))
    assert (stop.token_id, stop.eos_id, stop.finish_reason) == (None, 2, "stop")
    assert stop.logprob == pytest.approx(3.0 - np.log(np.exp(3.0) + V - 1))


def test_no_logprobs_unless_asked():
    rows = np.zeros((1, V), dtype=np.float32)
    (ev,) = events_from_result(streaming([4], rows), states(prompt_sent=True), n_vocab=V)
    assert ev.logprob is None and ev.top is None


def test_cached_tokens_of_a_job():
    assert cached_tokens(job(cached_pages=3, cached=5)) == 773
    assert cached_tokens(None) == 0


def test_prompt_entries():
    got = prompt_entries([-1.5, -0.25], [3, 1], [[4, 5], [6, 7]], [[-0.5, -1.0], [-0.25, float("-inf")]])
    assert got == [(None, None, None), (-1.5, 3, [(4, -0.5), (5, -1.0)]), (-0.25, 1, [(6, -0.25)])]
    assert prompt_entries([-2.0], [9], [], []) == [(None, None, None), (-2.0, 9, [])]
    assert prompt_entries([], [], [], []) == [(None, None, None)]
