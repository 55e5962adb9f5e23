"""/openapi.json describes what the two main routes answer, and what render builds fits it.

The app's document is built in-process (no services: the lifespan does not run). Rendered bodies
are checked against the very schemas the document publishes, so the declared models cannot drift
from the wire."""

from __future__ import annotations

from functools import cache
from typing import Any

import jsonschema
import pytest

from api.app import create_app
from core.generation.events import ChoiceResult, Delta, Done, JobResult, Usage
from core.protocol import render
from tests.unit.test_chunks import FP, _chat_job, _job

ROUTES = {
    "/v1/completions": ("Completion", "CompletionChunk"),
    "/v1/chat/completions": ("ChatCompletion", "ChatCompletionChunk"),
}


@cache
def _doc() -> dict[str, Any]:
    return create_app().openapi()


def _answers(path: str) -> dict[str, Any]:
    return _doc()["paths"][path]["post"]["responses"]


def _validate(instance: Any, schema: dict[str, Any]) -> None:
    jsonschema.validate(instance, {**schema, "components": _doc()["components"]})


@pytest.mark.parametrize("path", ROUTES)
def test_the_json_answer_and_the_stream_are_described(path):
    model, chunk = ROUTES[path]
    ok = _answers(path)["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    sse = ok["text/event-stream"]["schema"]
    assert sse["type"] == "string" and "[DONE]" in sse["description"] and chunk in sse["description"]
    assert sse["x-sse-data"]["title"] == chunk
    assert _answers(path)["202"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobObject"}
    for status in ("400", "409", "422", "429"):
        assert _answers(path)[status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }


def _succeeded():
    job = _job()
    job.result = JobResult(choices=[ChoiceResult(index=0, text="Hello", finish_reason="stop")]).model_dump()
    job.usage = Usage(prompt_tokens=3, completion_tokens=1).model_dump()
    return job


def test_a_rendered_completion_and_its_chunks_fit_the_published_schemas():
    ok = _answers("/v1/completions")["200"]["content"]
    _validate(render.response(_succeeded(), FP), ok["application/json"]["schema"])
    chunks = render.CompletionChunks(_job(), include_usage=True, fingerprint=FP)
    out = [*chunks.render(Delta(choice=0, text="Hi")), *chunks.render(Done(usage=Usage(prompt_tokens=1)))]
    bodies = [c for c in out if isinstance(c, dict)]
    assert len(bodies) == 2 and out[-1] == render.DONE
    for body in bodies:
        _validate(body, ok["text/event-stream"]["schema"]["x-sse-data"])
    _validate(render.job(_succeeded(), FP), _answers("/v1/completions")["202"]["content"]["application/json"]["schema"])


def test_a_rendered_chat_completion_and_its_chunks_fit_the_published_schemas():
    ok = _answers("/v1/chat/completions")["200"]["content"]
    job = _chat_job("Hello there", "stop", None)
    _validate(render.response(job, FP), ok["application/json"]["schema"])
    chunks = render.ChatChunks(_chat_job("", "stop", None), include_usage=False, fingerprint=FP)
    out = [c for c in chunks.render(Delta(choice=0, text="Hello", finish_reason="stop")) if isinstance(c, dict)]
    assert out and out[0]["object"] == "chat.completion.chunk"
    for body in out:
        _validate(body, ok["text/event-stream"]["schema"]["x-sse-data"])


def test_a_wrong_body_does_not_fit():
    """The schemas are not vacuous: a completion without choices is refused."""
    body = render.response(_succeeded(), FP)
    del body["choices"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(body, _answers("/v1/completions")["200"]["content"]["application/json"]["schema"])


@pytest.mark.parametrize(
    ("path", "media_type"),
    [("/v1/jobs/{job_id}/events", "text/event-stream"), ("/v1/files/{file_id}/content", "application/jsonl")],
)
def test_routes_that_answer_no_json_declare_only_what_they_send(path, media_type):
    """A replayed stream is SSE and a file's content its bytes: neither was to be declared as a JSON
    body with no schema (what FastAPI adds by default), which clients generated from the document
    would try to parse."""
    content = _doc()["paths"][path]["get"]["responses"]["200"]["content"]
    assert list(content) == [media_type]


def undescribed(doc: dict[str, Any]) -> set[str]:
    """The paths with a success answer declared as JSON without a schema."""
    out = set()
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for code, answer in op.get("responses", {}).items():
                content = answer.get("content", {})
                if (
                    code.startswith("2")
                    and "application/json" in content
                    and not content["application/json"].get("schema")
                ):
                    out.add(path)
    return out


def test_every_json_answer_has_a_schema():
    """CONTRIBUTING.md: a route declares its response_model, so /openapi.json describes what it answers.
    The five Responses routes were the last without one."""
    assert undescribed(_doc()) == set()
    assert _doc()["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]


# The Responses routes: each answer's published schema, and a job rendered in each state that fits it.
RESPONSE_ROUTES = {
    ("/v1/responses", "post"): "ResponseObject",
    ("/v1/responses/{response_id}", "get"): "ResponseObject",
    ("/v1/responses/{response_id}/cancel", "post"): "ResponseObject",
    ("/v1/responses/{response_id}", "delete"): "ResponseDeleted",
    ("/v1/responses/{response_id}/input_items", "get"): "InputItemList",
}


def _response_schema(path: str, method: str) -> dict[str, Any]:
    return _doc()["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize(("path", "method"), RESPONSE_ROUTES)
def test_the_responses_routes_publish_their_objects(path, method):
    assert _response_schema(path, method) == {"$ref": f"#/components/schemas/{RESPONSE_ROUTES[path, method]}"}


def test_rendered_responses_deletions_and_input_items_fit_the_published_schemas():
    from core.protocol import responses as wire
    from tests.helpers import response_job

    usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
    calls = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    jobs = [
        response_job("succeeded", {"choices": [{"index": 0, "text": "Hi.", "finish_reason": "stop"}]}, usage),
        response_job("succeeded", {"choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}]}, usage),
        response_job(
            "succeeded", {"choices": [{"index": 0, "text": calls, "finish_reason": "stop"}]}, usage, tools=True
        ),
        response_job("failed", None, None, error={"message": "boom", "type": "server_error", "code": "engine_error"}),
        response_job("running", None, None, instructions="Be brief.", metadata={"a": "b"}, background=True),
        response_job(
            "queued", None, None, input=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
        ),
    ]
    for job in jobs:
        _validate(render.response_of(job), _response_schema("/v1/responses/{response_id}", "get"))
        items = wire.page(wire.input_item_list(job), None, None, 20, "desc")
        assert items["data"]
        _validate(items, _response_schema("/v1/responses/{response_id}/input_items", "get"))
    assert {render.response_of(j)["status"] for j in jobs} == {
        "completed",
        "incomplete",
        "failed",
        "in_progress",
        "queued",
    }
    deleted = render.response_deleted(render.response_id(jobs[0].id))
    _validate(deleted, _response_schema("/v1/responses/{response_id}", "delete"))
    body = render.response_of(jobs[0])
    del body["output"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(body, _response_schema("/v1/responses/{response_id}", "get"))


def test_an_answer_without_a_schema_is_found():
    doc = {
        "paths": {
            "/a": {"get": {"responses": {"200": {"content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/b": {"post": {"responses": {"201": {"content": {"application/json": {}}}}}},
            "/c": {"get": {"responses": {"200": {"content": {"text/event-stream": {}}}}}},
        }
    }
    assert undescribed(doc) == {"/b"}
