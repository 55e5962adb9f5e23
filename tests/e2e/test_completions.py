"""The first acceptance lines: the official openai client against real processes and the real model."""

from __future__ import annotations

import pytest

from tests.conftest import MODEL, job_row


def test_models_lists_smollm2(stack):
    client = stack.openai()
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL and set(ids) == {MODEL, "gpt-3.5-turbo", "default"}  # the model, then its aliases
    assert client.models.retrieve(MODEL).id == MODEL


def test_capital_of_france_mentions_paris_and_is_recorded(stack, db):
    client = stack.openai()
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert resp.object == "text_completion"
    assert resp.model == MODEL
    assert len(resp.choices) == 1
    assert "Paris" in resp.choices[0].text
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 0 and 0 < resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    row = job_row(db, resp.id)
    assert row["state"] == "succeeded"
    # The ledger stores neutral usage; the response is its OpenAI rendering.
    stored = row["usage"]
    assert (stored["prompt_tokens"], stored["completion_tokens"]) == (
        resp.usage.prompt_tokens,
        resp.usage.completion_tokens,
    )
    assert row["result"]["choices"][0]["text"] == resp.choices[0].text
    assert row["finished_at"] is not None and row["attempt"] == 1


@pytest.mark.parametrize("seed", [7, 1234])
def test_stream_concatenation_equals_non_stream_for_same_seed(stack, seed):
    client = stack.openai()
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0.9, seed=seed)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert all(c.choices[0].text for c in text_chunks[:-1]), "no empty-text chunk before the end"
    streamed = "".join(c.choices[0].text for c in text_chunks)
    assert streamed == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_prompt_array_and_n_index_choices_prompt_major(stack):
    client = stack.openai()
    resp = client.completions.create(
        model=MODEL, prompt=["Hello, my name is", "1, 2, 3,"], n=2, max_tokens=6, temperature=0.8, seed=3
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert all(c.text for c in resp.choices)
    # Two samples of the same prompt with the same request seed still differ: each choice has its own RNG.
    assert resp.choices[0].text != resp.choices[1].text or resp.choices[2].text != resp.choices[3].text


def test_stop_string_is_not_returned(stack):
    client = stack.openai()
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert "," in text, text
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[","])
    assert cut.choices[0].text == text[: text.index(",")]
    assert cut.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(stack):
    resp = stack.openai().completions.create(
        model=MODEL, prompt="Count: one, two,", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3


def test_user_field_is_stored(stack, db):
    resp = stack.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="end-user-42")
    assert job_row(db, resp.id)["user"] == "end-user-42"
