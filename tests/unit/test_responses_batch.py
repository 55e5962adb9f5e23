"""The Responses API beyond one request (issue 37): `/v1/responses` lines of a batch validated into
chat jobs (core/batches/ingest.py) and answered as `response` objects (core/protocol/render.py), and
a cancelled response showing what it generated (the partial result and usage the cancel keeps on
the row, core/jobs/lifecycle.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from core.batches import ingest
from core.config import Settings
from core.generation.events import Delta
from core.infra.orm import Batch
from core.jobs.lifecycle import partial_result
from core.protocol import render
from tests.helpers import response_job

MODEL = "smollm2-135m-instruct"
ENDPOINT = "/v1/responses"


def _row(body: dict[str, Any]) -> dict[str, Any]:
    b = Batch(id="batch_x", tenant_id=1, key_id=None, endpoint=ENDPOINT)
    raw = json.dumps({"custom_id": "r1", "method": "POST", "url": ENDPOINT, "body": body}).encode()
    return ingest._job_row(1, raw, b, Settings(unknown_params="error"))


def _refused(body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ingest._LineError) as caught:
        _row(body)
    return caught.value.entry


def test_a_responses_line_is_a_chat_job_that_remembers_it_is_a_response():
    row = _row(
        {
            "model": MODEL,
            "instructions": "Be terse.",
            "input": "Say hi.",
            "max_output_tokens": 7,
            "metadata": {"case": "batch"},
            "temperature": 0,
        }
    )
    assert row["model"] == MODEL and row["kind"] == "batch" and row["custom_id"] == "r1"
    m = row["chat"]["response"]
    assert m["instructions"] == "Be terse." and m["metadata"] == {"case": "batch"} and m["max_output_tokens"] == 7
    assert m["input"] == [{"type": "message", "role": "user", "content": "Say hi."}]
    assert row["params"]["max_tokens"] == 7
    # The prompt went through the chat template: the instructions are the system message.
    ids = row["prompts"][0]["ids"]
    assert ids and row["reserved_tokens"] >= len(ids) + 7


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"stream": True}, "body.stream", "invalid_request"),
        ({"background": True}, "body.background", "unsupported_parameter"),
        ({"previous_response_id": "resp_0123"}, "body.previous_response_id", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "body.tools[0].type", "unsupported_parameter"),
        ({"max_output_tokens": 0}, "body.max_output_tokens", None),
        ({"max_output_tokens": 10**9}, "body.max_output_tokens", None),
        ({"text": {"format": {"type": "yaml"}}}, "body.text.format.type", None),
        ({"frobnicate": 1}, "body.frobnicate", "unknown_parameter"),
        ({"conversation": "conv_1"}, "body.conversation", "unsupported_parameter"),
    ],
)
def test_a_responses_line_spool_cannot_run_is_refused_naming_the_field(body, param, code):
    entry = _refused({"model": MODEL, "input": "Hi", **body})
    assert entry["param"] == param, entry
    if code:
        assert entry["code"] == code, entry


def test_a_line_with_another_endpoints_url_is_refused():
    b = Batch(id="batch_x", tenant_id=1, key_id=None, endpoint=ENDPOINT)
    raw = json.dumps({"custom_id": "r1", "url": "/v1/chat/completions", "body": {"model": MODEL, "input": "Hi"}})
    with pytest.raises(ingest._LineError) as caught:
        ingest._job_row(1, raw.encode(), b, Settings())
    assert caught.value.entry["code"] == "mismatched_url"


def test_a_responses_batch_output_body_is_the_response_object_and_a_chat_ones_is_not():
    done = response_job(
        "succeeded",
        {"choices": [{"index": 0, "text": "Hello.", "finish_reason": "stop"}]},
        {"prompt_tokens": 9, "completion_tokens": 2},
    )
    body = render.batch_body(done, "fp")
    assert body == render.response_of(done)
    assert body["object"] == "response" and body["id"] == "resp_0123456789abcdef01234567"
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == "Hello."
    assert body["usage"]["input_tokens"] == 9 and body["usage"]["output_tokens"] == 2
    chat = SimpleNamespace(**{**vars(done), "chat": {"tools": False, "top_logprobs": None}})
    assert render.batch_body(chat, "fp")["object"] == "chat.completion"
    # A response's job object (`GET /v1/jobs/{id}`) keeps its chat completion as its result.
    assert render.job(done, "fp")["result"]["object"] == "chat.completion"


def test_a_cancelled_jobs_partial_result_is_the_text_its_stream_carried():
    deltas = [
        Delta(choice=0, text="Once", token_ids=[1]),
        Delta(choice=0, text=" upon", token_ids=[2]),
        Delta(choice=1, text="A\x00b", token_ids=[3]),
    ]
    kept = partial_result(deltas)
    assert kept is not None
    assert [(c["index"], c["text"], c["finish_reason"]) for c in kept["choices"]] == [
        (0, "Once upon", None),
        (1, "A\ufffdb", None),  # storable in JSONB: the NUL replaced
    ]
    assert partial_result([]) is None and partial_result([Delta(choice=0, text="", token_ids=[])]) is None


def test_a_cancelled_response_shows_what_it_generated_and_its_usage():
    partial = partial_result([Delta(choice=0, text="Once upon", token_ids=[1, 2])])
    r = render.response_of(response_job("cancelled", partial, {"prompt_tokens": 12, "completion_tokens": 2}))
    assert r["status"] == "cancelled" and r["completed_at"] is None and r["error"] is None
    assert [(o["type"], o["status"], o["content"][0]["text"]) for o in r["output"]] == [
        ("message", "incomplete", "Once upon")
    ]
    assert r["usage"]["input_tokens"] == 12 and r["usage"]["output_tokens"] == 2 and r["usage"]["total_tokens"] == 14
    # Cancelled before it generated anything (or while Redis was away): no output, usage as billed.
    bare = render.response_of(response_job("cancelled", None, {"prompt_tokens": 0, "completion_tokens": 0}))
    assert bare["output"] == [] and bare["usage"]["output_tokens"] == 0
