"""Events -> OpenAI stream chunks, validated against the reference schema (pure)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import pytest

from api.streaming import ChunkWriter
from core.models import Job

SPEC = Path(__file__).resolve().parents[3] / "shared" / "reference" / "openai-openapi-subset.json"


def _schema():
    if not SPEC.exists():
        pytest.skip("shared/reference not beside the checkout")
    spec = json.loads(SPEC.read_text())
    schema = spec["components"]["schemas"]["CreateCompletionResponse"]
    return {**schema, "components": spec["components"]}


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
    assert body["usage"] is None
    body.pop("usage")
    body.pop("system_fingerprint")
    choice = body["choices"][0]
    choice["finish_reason"] = "length"  # the schema's enum has no null; final chunks carry one
    jsonschema.validate(body, _schema())


def test_empty_delta_without_finish_is_not_sent():
    assert (
        ChunkWriter(_job(), False).render("1-0", {"type": "delta", "choice": 0, "text": "", "finish_reason": None})
        == []
    )


def test_done_sends_usage_then_done_marker():
    out = ChunkWriter(_job(), include_usage=True).render("2-0", {"type": "done", "usage": {"prompt_tokens": 1}})
    assert json.loads(_data(out[0]))["choices"] == []
    assert _data(out[1]) == "[DONE]"
    assert [_data(b) for b in ChunkWriter(_job(), False).render("2-0", {"type": "done"})] == ["[DONE]"]
