"""Stored chat completions' pure parts (core/jobs/chat_store.py, core/protocol/render.py): what a
`store: true` request keeps, how a list's `metadata[key]=value` filter is read and bounded, and the
stored object, message and deletion in the shapes the installed `openai` SDK parses."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionDeleted, ChatCompletionStoreMessage

from core.errors import DomainError
from core.jobs.chat_store import is_deleted, kept, metadata_filter
from core.protocol import render, schemas
from core.protocol.schemas import ChatCompletionRequest
from core.protocol.sdk_params import CHAT, Answer

PARTS = [{"type": "text", "text": "Capital"}, {"type": "text", "text": "of France?"}]
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": PARTS, "name": "ann"}]


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **kw})


def test_store_true_keeps_the_messages_as_sent_and_the_metadata_and_nothing_else_keeps_anything():
    assert kept(_request(store=True, metadata={"topic": "geo"})) == {"messages": MESSAGES, "metadata": {"topic": "geo"}}
    assert kept(_request(store=True)) == {"messages": MESSAGES, "metadata": {}}
    assert kept(_request(metadata={"topic": "geo"})) is None  # OpenAI's default: not stored
    assert kept(_request(store=False, metadata={"topic": "geo"})) is None


def test_only_a_deleted_stored_completion_reads_as_deleted():
    assert is_deleted({"tools": False, "deleted": True})
    assert not is_deleted({"tools": False, "stored": {"messages": [], "metadata": {}}})
    assert not is_deleted(None)


def test_the_list_filter_is_the_querys_metadata_pairs_bounded_as_metadata_is():
    query = {"metadata[topic]": "geo", "metadata[run]": "1", "limit": "2", "metadata": "x"}
    assert metadata_filter(query) == {"topic": "geo", "run": "1"}
    assert metadata_filter({}) == {}
    with pytest.raises(DomainError) as long_key:
        metadata_filter({"metadata[" + "k" * 65 + "]": "v"})
    assert long_key.value.param == "metadata"
    with pytest.raises(DomainError):
        metadata_filter({f"metadata[k{n}]": "v" for n in range(17)})


def _job() -> SimpleNamespace:
    return SimpleNamespace(
        id="cmpl-abc",
        model="m",
        state="succeeded",
        chat={"tools": False, "top_logprobs": None},
        result={"choices": [{"index": 0, "text": "Paris.", "finish_reason": "stop"}]},
        usage={"prompt_tokens": 5, "completion_tokens": 2},
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        service_tier="default",
    )


def test_a_stored_completion_is_the_created_object_with_its_metadata_and_parses_in_the_sdk():
    job = _job()
    body = render.stored_chat_completion(job, "fp_1", {"topic": "geo"})
    assert body == {**render.chat_completion(job, "fp_1"), "metadata": {"topic": "geo"}}
    parsed = ChatCompletion.model_validate(body)
    assert parsed.metadata == {"topic": "geo"} and parsed.choices[0].message.content == "Paris."
    assert render.stored_chat_completion(job, "fp_1", None)["metadata"] == {}
    schemas.StoredChatCompletion.model_validate(body)  # what /openapi.json publishes for the routes
    schemas.StoredChatCompletionList.model_validate(render.page([body], False))


def test_stored_messages_and_the_deletion_in_the_sdks_shapes():
    system, user = (render.stored_chat_message("cmpl-abc", n, m) for n, m in enumerate(MESSAGES))
    assert system == {"id": "cmpl-abc-0", "role": "system", "content": "Be terse.", "name": None, "content_parts": None}
    assert user["id"] == "cmpl-abc-1" and user["name"] == "ann"
    assert (user["content"], user["content_parts"]) == ("Capital\nof France?", PARTS)  # joined as the prompt was
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assistant = render.stored_chat_message("cmpl-abc", 2, {"role": "assistant", "tool_calls": [call]})
    assert assistant["tool_calls"] == [call] and assistant["content"] is None
    tool = render.stored_chat_message("cmpl-abc", 3, {"role": "tool", "content": "22C", "tool_call_id": "call_1"})
    assert tool["tool_call_id"] == "call_1"
    for m in (system, user, assistant, tool):
        # Every field as the SDK types it; its type says `role: "assistant"` only, where OpenAI answers
        # each message's own role (and the SDK, parsing leniently, keeps it).
        assert ChatCompletionStoreMessage.model_validate({**m, "role": "assistant"}).id == m["id"]
    schemas.StoredChatMessageList.model_validate(render.page([system, user, assistant, tool], False))
    deleted = render.chat_completion_deleted("cmpl-abc")
    schemas.ChatCompletionDeleted.model_validate(deleted)
    assert ChatCompletionDeleted.model_validate(deleted).deleted is True
    assert deleted == {"id": "cmpl-abc", "object": "chat.completion.deleted", "deleted": True}


def test_chat_store_and_metadata_are_honoured():
    assert CHAT["store"].answer is Answer.honoured and CHAT["metadata"].answer is Answer.honoured
