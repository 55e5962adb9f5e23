"""Bad input: OpenAI-shaped errors with the right status, and nothing stored."""

from __future__ import annotations

import json

import pytest

from tests.conftest import MODEL, count_jobs

GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}


def _assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"prompt": "x"}, 400, "model", "missing_parameter"),
        ({"model": MODEL}, 400, "prompt", "missing_parameter"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model", "model_not_found"),
        ({**GOOD, "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
        ({**GOOD, "temperature": "hot"}, 400, "temperature", "invalid_value"),
        ({**GOOD, "temperature": 3}, 400, "temperature", "invalid_value"),
        ({**GOOD, "n": 0}, 400, "n", "invalid_value"),
        ({**GOOD, "stream": "yes"}, 400, "stream", "invalid_value"),
        ({**GOOD, "stop": ["a"] * 17}, 400, "stop", "invalid_value"),
        ({**GOOD, "prompt": []}, 400, "prompt", "invalid_value"),
        ({**GOOD, "prompt": 42}, 400, "prompt", "invalid_value"),
        ({**GOOD, "model": 7}, 400, "model", "invalid_value"),
        ({**GOOD, "frobnicate": True}, 400, "frobnicate", "unknown_parameter"),
        ({**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    ],
)
def test_bad_bodies(stack, db, body, status, param, code):
    before = count_jobs(db)
    with stack.http(stack.keys["alpha"]) as http:
        _assert_error(http.post("/v1/completions", json=body), status, param, code)
    assert count_jobs(db) == before


@pytest.mark.parametrize("raw", [b'{"model": "x",', b"not json", b"[1, 2]", b'"a string"', b""])
def test_invalid_json(stack, db, raw):
    before = count_jobs(db)
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    _assert_error(r, 400)
    assert count_jobs(db) == before


@pytest.mark.parametrize("auth", [None, "Bearer", "Bearer sk-spool-wrong", "Basic abc"])
def test_bad_key(stack, db, auth):
    before = count_jobs(db)
    with stack.http() as http:
        headers = {"Authorization": auth} if auth else {}
        _assert_error(http.post("/v1/completions", json=GOOD, headers=headers), 401)
        _assert_error(http.get("/v1/models", headers=headers), 401)
    assert count_jobs(db) == before


def test_openai_client_raises_typed_errors(stack):
    import openai

    client = stack.openai()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    bad = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x")


def test_body_too_large(stack, db):
    before = count_jobs(db)
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post("/v1/completions", json={**GOOD, "prompt": "x" * (9 * 1024 * 1024)})
    _assert_error(r, 413)
    assert count_jobs(db) == before


def test_unknown_route_and_model(stack):
    with stack.http(stack.keys["alpha"]) as http:
        _assert_error(http.get("/v1/nope"), 404)
        _assert_error(http.get("/v1/models/nope"), 404, "model", "model_not_found")
        _assert_error(http.get("/v1/jobs/cmpl-doesnotexist"), 404, code="job_not_found")
        _assert_error(http.get("/v1/jobs/x/events", headers={"Last-Event-ID": "garbage"}), 404)


@pytest.mark.parametrize("field", [{"user": "a\u0000b"}, {"prompt": "a\u0000b"}, {"prompt": "\ud800x"}])
def test_values_postgres_cannot_store_are_400_and_store_nothing(stack, db, field):
    before = count_jobs(db)
    with stack.http(stack.keys["alpha"]) as http:
        body = json.dumps({**GOOD, **field}).encode()  # raw: httpx would refuse the lone surrogate
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_value"
    assert count_jobs(db) == before
