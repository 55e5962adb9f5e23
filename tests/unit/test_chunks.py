"""Events -> OpenAI stream chunks, validated against the reference schema (pure)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from api.streaming import ChunkWriter
from core.models import Job
from tests import openapi

pytestmark = pytest.mark.skipif(not openapi.available(), reason="shared/reference not beside the checkout")


def _job():
    return Job(id="cmpl-x", model="m", created_at=datetime(2026, 1, 1, tzinfo=UTC))


def _data(raw: bytes) -> str:
    return "\n".join(line[6:] for line in raw.decode().splitlines() if line.startswith("data: "))


def test_delta_chunk_matches_schema_and_carries_id():
    out = ChunkWriter(_job(), include_usage=True).render(
        "1-0", {"type": "delta", "choice": 0, "text": "Hi", "finish_reason": None}
    )
    assert out[0].decode().count("id: 1-0") == 1
    body = json.loads(_data(out[0]))
    assert body["choices"][0] == {"text": "Hi", "index": 0, "logprobs": None, "finish_reason": None}
    assert "usage" not in body  # only the final chunk carries usage
    openapi.validate(body, "CreateCompletionResponse", chunk=True)


def test_empty_delta_without_finish_is_not_sent():
    ev = {"type": "delta", "choice": 0, "text": "", "finish_reason": None}
    assert ChunkWriter(_job(), False).render("1-0", ev) == []


def test_done_sends_usage_then_done_marker():
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    out = ChunkWriter(_job(), include_usage=True).render("2-0", {"type": "done", "usage": usage})
    body = json.loads(_data(out[0]))
    assert body["choices"] == [] and body["usage"] == usage
    openapi.validate(body, "CreateCompletionResponse", chunk=True)
    assert _data(out[1]) == "[DONE]"
    assert [_data(b) for b in ChunkWriter(_job(), False).render("2-0", {"type": "done"})] == ["[DONE]"]
