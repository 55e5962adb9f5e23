"""Speculative decoding's pure parts (workers/engine/drafts.py): where drafts come from, the
acceptance rule (and that a wrong one is caught by the same statistics), and the back-off."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine import drafts


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_match():
    look = drafts.Lookup()
    look.see([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 2, 3])
    # "2 3" last occurred before the end at 7..: the latest earlier occurrence wins (then 3-grams first)
    assert look.draft(3) == [7, 8, 6]
    look.see([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 2, 3, 4])  # only the new token is read
    assert look.draft(2) == [5, 9]  # "2 3 4" matches at the start
    assert look.draft(0) == []


def test_prompt_lookup_drafts_nothing_without_a_match():
    look = drafts.Lookup()
    look.see([5, 6, 7, 8])
    assert look.draft(4) == []


def test_a_prediction_drafts_from_where_the_output_stands_and_realigns_after_an_edit():
    pred = list(range(100, 120))
    p = drafts.Prediction(pred, start=3)  # the output starts after a 3-token prompt
    prompt = [1, 2, 3]
    assert p.draft(4) == [100, 101, 102, 103]
    p.see([*prompt, 100, 101])
    assert p.draft(3) == [102, 103, 104]
    # an edit: two tokens not in the prediction replace 102..103; no alignment until the output
    # meets the prediction's text again
    out = [100, 101, 7, 8]
    p.see(prompt + out)
    assert p.draft(3) == []
    out += [104, 105]
    p.see(prompt + out)
    assert p.draft(3) == [106, 107, 108]


def test_realignment_prefers_the_occurrence_at_or_after_the_output_position():
    pred = [9, 1, 2, 5, 9, 1, 2, 6, 9, 1, 2, 7]
    p = drafts.Prediction(pred, start=0)
    p.see([4, 4, 4, 4, 4, 9, 1, 2])  # 8 tokens out: the occurrence ending at 11 (after 8) is taken
    assert p.draft(1) == [7]


def test_verify_keeps_draft_tokens_while_the_draw_equals_them():
    draws = iter([10, 11, 99, 13])
    out, accepted = drafts.verify([10, 11, 12], lambda i: next(draws))
    assert (out, accepted) == ([10, 11, 99], 2)
    out, accepted = drafts.verify([10, 11], lambda i: [10, 11, 12][i])
    assert (out, accepted) == ([10, 11, 12], 2)  # the whole draft, then the next token
    out, accepted = drafts.verify([10, 11], lambda i: None)  # the sequence ended at the first row
    assert (out, accepted) == ([None], 0)


def _always_accept(draft, sample):
    """A planted wrong rule: the draft is taken whatever the model's draw was."""
    out = [*draft, sample(len(draft))]
    return out, len(draft)


def _first_two(rule, rng: np.random.Generator, rows: np.ndarray, draft: list[int], n: int) -> np.ndarray:
    """The distribution of the pair (token 0, token 1) over n generations by `rule`, each step
    drafting what is left of `draft`; the toy model's next-token distribution is the row of the
    previous token (the first token's: row 0)."""
    counts = np.zeros((rows.shape[1], rows.shape[1]))
    for _ in range(n):
        history: list[int] = []
        while len(history) < 2:
            step = draft[len(history) :]
            before = [0, *history]

            def sample(i: int, step=step, before=before) -> int:
                prev = [*before, *step[:i]][-1]  # row i follows the draft tokens before it
                return int(rng.choice(rows.shape[1], p=rows[prev]))

            history += rule(step, sample)[0]
        counts[history[0], history[1]] += 1
    return counts / n


@pytest.mark.parametrize("rule, holds", [(drafts.verify, True), (_always_accept, False)])
def test_sampled_output_follows_the_model_with_drafts_and_a_wrong_rule_is_caught(rule, holds):
    """Without drafts the first two tokens follow p(a) p(b|a). With a draft, the acceptance rule must
    give the same joint distribution (total variation within sampling noise); one that keeps the
    draft regardless does not."""
    rng = np.random.default_rng(7)
    rows = rng.dirichlet(np.ones(6), size=6)
    truth = rows[0][:, None] * rows  # p(a) p(b | a)
    got = _first_two(rule, rng, rows, draft=[2, 3], n=20000)
    tv = 0.5 * np.abs(got - truth).sum()
    assert bool(tv < 0.03) == holds, tv


def test_back_off_drafts_less_when_acceptance_falls_and_probes_again():
    b = drafts.Backoff(prior=0.9)
    assert b.want(1) >= 3
    for _ in range(6):
        b.update(4, 0)  # every draft rejected at once
    assert b.want(1) == 0
    probes = [b.want(1) for _ in range(b.probe_every)]
    assert probes.count(1) == 1 and probes.count(0) == b.probe_every - 1
    for _ in range(20):
        b.update(4, 4)
    assert b.want(1) >= 3


def test_a_full_batch_leaves_no_room_for_drafts_that_do_not_nearly_always_hold():
    assert drafts.choose_k(0.7, live=1) > 0
    assert drafts.choose_k(0.7, live=16) == 0
    assert drafts.choose_k(0.99, live=16) > 0
    assert drafts.choose_k(0.3, live=1) == 0
    assert all(drafts.choose_k(r, live) <= drafts.K_MAX for r in (0.5, 0.999) for live in (1, 4))
