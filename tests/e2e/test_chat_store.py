"""Stored chat completions (`store: true`, issue 51) through the official `openai` client against the
real stack and SmolLM2: create with store and metadata, retrieve, list with a metadata filter (the
SDK's cursor pages), list the messages, update the metadata, delete; a completion created without
`store` is not kept, and another tenant sees none of it."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.conftest import MODEL

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_a_stored_chat_completion_is_retrieved_listed_updated_and_deleted_through_the_sdk(stack):
    client, beta = stack.openai(), stack.openai("beta")
    run = uuid.uuid4().hex  # this test's completions, whatever else the session's tenant stored

    def create(**kw):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, **kw)

    made = create(store=True, metadata={"run": run, "topic": "geo"})
    second = create(store=True, metadata={"run": run, "topic": "math"})
    unstored = create(metadata={"run": run, "topic": "geo"})  # `store` omitted: OpenAI's default, not kept

    got = client.chat.completions.retrieve(made.id)
    assert got.metadata == {"run": run, "topic": "geo"}
    assert got.model_dump(exclude={"metadata"}) == made.model_dump(exclude={"metadata"})  # as it was answered
    assert got.choices[0].message.content == made.choices[0].message.content

    geo = client.chat.completions.list(metadata={"run": run, "topic": "geo"})
    assert [c.id for c in geo] == [made.id]
    # One per page: the SDK follows the cursor (`after`) through every page, oldest first.
    assert [c.id for c in client.chat.completions.list(metadata={"run": run}, limit=1)] == [made.id, second.id]
    assert [c.id for c in client.chat.completions.list(metadata={"run": run}, order="desc")] == [second.id, made.id]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(unstored.id)

    asked = list(client.chat.completions.messages.list(made.id))
    assert [(m.id, m.role, m.content) for m in asked] == [
        (f"{made.id}-{n}", m["role"], m["content"]) for n, m in enumerate(MESSAGES)
    ]

    updated = client.chat.completions.update(made.id, metadata={"run": run, "topic": "history"})
    assert updated.id == made.id and updated.metadata == {"run": run, "topic": "history"}
    assert [c.id for c in client.chat.completions.list(metadata={"run": run, "topic": "geo"})] == []
    assert client.chat.completions.retrieve(made.id).metadata == {"run": run, "topic": "history"}

    # Another tenant: the same 404 as an unknown id, nothing listed, nothing changed.
    for attempt in (
        lambda: beta.chat.completions.retrieve(made.id),
        lambda: beta.chat.completions.messages.list(made.id),
        lambda: beta.chat.completions.update(made.id, metadata={"topic": "theirs"}),
        lambda: beta.chat.completions.delete(made.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert list(beta.chat.completions.list(metadata={"run": run})) == []
    assert client.chat.completions.retrieve(made.id).metadata == {"run": run, "topic": "history"}

    deleted = client.chat.completions.delete(made.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (made.id, True, "chat.completion.deleted")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(made.id)
    assert [c.id for c in client.chat.completions.list(metadata={"run": run})] == [second.id]
