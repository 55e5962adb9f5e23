"""The pure parts of an attempt: a choice's state as engine events arrive, logprob assembly, the
deltas it publishes, best_of, usage (workers/choices.py) and resume arithmetic (workers/resume.py)."""

from __future__ import annotations

import pytest

from core.generation.events import Delta, Done, TokenScore, TopToken
from workers import choices, resume
from workers.choices import Choice
from workers.engine.base import PromptEvent, TokenEvent
from workers.engine.text import ChoiceText
from workers.outcome import JobError

VOCAB = {1: "He", 2: "llo", 3: " wor", 4: "ld", 5: "!", 9: "</s>"}


def name(t: int) -> str:
    return VOCAB[t]


def _choice(index: int = 0, prompt: int = 0, stop: tuple[str, ...] = (), logprobs: bool = True) -> Choice:
    ch = Choice(index, prompt, ChoiceText(stop, lambda t: VOCAB[t].encode()), ("job", 1, index))
    ch.lp = [] if logprobs else None
    return ch


def _tok(t: int | None, lp: float | None = -0.5, finish: str | None = None, **kw) -> TokenEvent:
    return TokenEvent(("job", 1, 0), t, lp, finish, **kw)


def test_tokens_become_text_scores_with_offsets_and_a_running_sum():
    ch = _choice()
    ch.prefix_text = "Hi: "  # echoed prompt: offsets count it
    assert not choices.take_token(ch, _tok(1, -0.25, top=[(1, -0.25), (3, -2.0)]), name)
    assert not choices.take_token(ch, _tok(2, -0.75), name)
    assert ch.text.text == "Hello" and ch.sum_lp == -1.0 and not ch.done
    assert ch.lp == [
        TokenScore(
            id=1,
            text="He",
            logprob=-0.25,
            offset=4,
            top=[TopToken(id=1, text="He", logprob=-0.25), TopToken(id=3, text=" wor", logprob=-2.0)],
        ),
        TokenScore(id=2, text="llo", logprob=-0.75, offset=6),
    ]


def test_an_eos_token_is_scored_counted_and_ends_the_choice():
    ch = _choice()
    choices.take_token(ch, _tok(1), name)
    assert not choices.take_token(ch, _tok(None, -0.1, "stop", eos_id=9), name)
    assert ch.done and ch.eos and ch.text.finish_reason == "stop"
    assert ch.lp is not None and ch.lp[-1] == TokenScore(id=9, text="</s>", logprob=-0.1, offset=2)
    assert choices.usage([ch], [3]).completion_tokens == 2  # the generated EOS is a completion token


def test_a_stop_string_ends_the_choice_and_asks_the_engine_to_stop():
    ch = _choice(stop=("lo",))
    assert not choices.take_token(ch, _tok(1), name)
    assert choices.take_token(ch, _tok(2), name)  # "Hello" holds the stop string: the engine must be told
    assert ch.done and ch.text.finish_reason == "stop" and ch.text.text == "Hel"


def test_deltas_carry_only_what_is_new_and_the_last_one_closes_the_choice():
    ch = _choice()
    choices.take_token(ch, _tok(1), name)
    [d1] = choices.deltas([ch, ch], attempt=2, echo=False)  # each choice once
    assert (d1.text, d1.token_ids, d1.attempt, d1.finish_reason) == ("He", [1], 2, None)
    assert choices.deltas([ch], attempt=2, echo=False) == []  # nothing new: no empty delta
    choices.take_token(ch, _tok(2, finish="length"), name)
    [d2] = choices.deltas([ch], attempt=2, echo=False)
    assert (d2.text, d2.token_ids, d2.finish_reason) == ("llo", [2], "length")
    assert d2.scores is not None and [s.id for s in d2.scores] == [2]
    assert ch.closed and choices.deltas([ch], attempt=2, echo=False) == []


def test_the_echoed_prompt_and_its_scores_go_out_once_with_the_first_delta():
    ch = _choice()
    ch.prefix_text = "He"
    choices.take_prompt(ch, PromptEvent(ch.key, cached=1, entries=[(None, None, None)]), [1], name)
    assert ch.prefix_ready and ch.cached == 1
    assert ch.prompt_scores == [TokenScore(id=1, text="He", logprob=None, offset=0)]
    [d] = choices.deltas([ch], attempt=1, echo=True)
    assert (d.text, d.prefix_len, d.prompt_scores) == ("He", 2, ch.prompt_scores)
    choices.take_token(ch, _tok(2), name)
    [d] = choices.deltas([ch], attempt=1, echo=True)
    assert (d.text, d.prefix_len, d.prompt_scores) == ("llo", None, None)


def test_prompt_scores_offsets_and_alternatives():
    out = choices.prompt_scores([1, 2], [(None, None, None), (-1.5, 3, [(2, -1.5), (4, -2.5)])], name)
    assert out == [
        TokenScore(id=1, text="He", logprob=None, rank=None, offset=0),
        TokenScore(
            id=2,
            text="llo",
            logprob=-1.5,
            rank=3,
            offset=2,
            top=[TopToken(id=2, text="llo", logprob=-1.5), TopToken(id=4, text="ld", logprob=-2.5)],
        ),
    ]


def test_best_of_keeps_the_n_best_by_mean_logprob_per_prompt_renumbered():
    cands = {}
    for i, (prompt, lps) in enumerate([(0, [-1.0, -1.0]), (0, [-0.1]), (0, [-3.0]), (1, [-2.0]), (1, [-0.5, -0.5])]):
        ch = _choice(index=i, prompt=prompt)
        for lp in lps:
            choices.take_token(ch, _tok(1, lp), name)
        cands[i] = ch
    best = choices.best_of(cands, prompts=2, n=1, candidates=3)
    assert {k: v.index for k, v in best.items()} == {0: 1, 1: 4}
    assert choices.best_of(cands, prompts=2, n=3, candidates=3) is cands  # best_of <= n: every choice
    [d] = choices.deltas([best[1]], attempt=1, echo=False, index_of={best[1]: 1})
    assert d.choice == 1


def test_results_and_usage_with_cached_prompt_prefixes():
    a, b = _choice(0, 0), _choice(1, 1)
    a.prefix_text, a.cached, b.cached = "He", 2, 1
    choices.take_token(a, _tok(2, finish="length"), name)
    r = choices.result(0, a)
    assert (r.text, r.prefix_len, r.finish_reason) == ("Hello", 2, "length")
    u = choices.usage([a, b], [2, 3])
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (5, 1, 3)


# -- resume ------------------------------------------------------------------------------------


def test_prior_progress_rebuilds_each_choice_from_the_stream():
    events = [
        Delta(choice=0, text="Q: He", token_ids=[1], prefix_len=3),
        Delta(choice=1, text="llo", token_ids=[2]),
        Delta(choice=0, text="llo", token_ids=[2], finish_reason="stop", eos=True),
        Done(usage={"prompt_tokens": 1}),
    ]
    prior = resume.prior_progress(events)
    assert prior[0] == resume.Prior(ids=[1, 2], text="Hello", finish="stop", prefix_sent=True, eos=True)
    assert prior[1] == resume.Prior(ids=[2], text="llo")


def test_a_resumed_choice_continues_where_the_stream_stopped():
    ch = _choice()
    ch.resume(resume.Prior(ids=[1], text="He", prefix_sent=True), echo=True, prompt_scores_wanted=False)
    assert (ch.text.ids, ch.sent_ids, ch.prefix_sent, ch.prefix_ready, ch.done) == ([1], 1, True, False, False)
    choices.take_token(ch, _tok(2), name)
    [d] = choices.deltas([ch], attempt=2, echo=True)
    assert (d.text, d.token_ids) == ("llo", [2])  # nothing the client saw is sent twice
    ended = _choice()
    ended.resume(resume.Prior(ids=[1], text="He", finish="stop", eos=True), echo=False, prompt_scores_wanted=False)
    assert ended.done and ended.closed and ended.eos
    fresh = _choice()
    fresh.resume(resume.Prior(), echo=True, prompt_scores_wanted=True)
    assert not fresh.prefix_ready  # echo with prompt scores waits for the scored prompt


def test_budget_remaining_and_seed_arithmetic():
    assert resume.budget(n_ctx=10, prompt_len=4, max_tokens=None, prompt_index=0) == 6  # to the context's end
    assert resume.budget(10, 4, 3, 0) == 3 and resume.budget(10, 4, 30, 0) == 6
    assert resume.budget(10, 10, 0, 0) == 0  # prefill only (scoring a prompt)
    with pytest.raises(JobError) as exc:
        resume.budget(10, 10, 5, 1)
    assert exc.value.error.code == "context_length_exceeded" and "prompt 1 has 10" in exc.value.error.message
    assert resume.remaining(6, 4) == 2 and resume.remaining(6, 9) == 0
    assert resume.seed_for(7, 2, 0) == 9 and resume.seed_for(7, 2, 3) == 9 + 3_000_009
    assert resume.seed_for(2**63 - 1, 1, 0) == 0  # kept within 63 bits
