"""OpenAI JSON -> GenerationParams, the one translation at the edge (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.schemas import CompletionRequest


def req(**kw):
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", **kw})


def test_defaults_follow_openai():
    p = req().to_params(default_max_tokens=16)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop) == (16, 1.0, 1.0, 1, ())
    assert isinstance(p.seed, int)  # chosen at the edge, so a resumed attempt replays


def test_minus_one_means_rest_of_context_and_stop_string_becomes_tuple():
    p = req(max_tokens=-1, stop="\n", seed=3).to_params(16)
    assert p.max_tokens is None and p.stop == ("\n",) and p.seed == 3


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_forms_normalize(prompt, expected):
    assert req(prompt=prompt).prompts() == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": "5"},
        {"temperature": 2.5},
        {"top_p": 0},
        {"n": 129},
        {"stop": ["a"] * 5},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [-1]},
        {"unknown": 1},
        {"stream": 1},
    ],
)
def test_rejected(bad):
    with pytest.raises(ValidationError):
        req(**bad)


def test_int_accepted_for_float():
    assert req(temperature=1).to_params(16).temperature == 1.0
