"""SPOOL_ENGINE=null: the whole queue path with no model, for measuring the path itself."""

from __future__ import annotations

import pytest

from tests.conftest import MODEL, TEST_DB, running_stack
from tests.sse import collect


@pytest.fixture(scope="module")
def null_stack(tmp_path_factory):
    db = TEST_DB.rsplit("/", 1)[0] + "/spool_null"
    with running_stack(tmp_path_factory.mktemp("null-logs"), db, "redis://127.0.0.1:6379/9", SPOOL_ENGINE="null") as st:
        yield st


def test_null_engine_answers_every_path_deterministically(null_stack):
    with null_stack.http(null_stack.keys["alpha"]) as http:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 7, "seed": 1}
        a, b = http.post("/v1/completions", json=body).json(), http.post("/v1/completions", json=body).json()
        assert a["usage"]["completion_tokens"] == 7 and a["choices"][0]["finish_reason"] == "length"
        assert a["choices"][0]["text"] == b["choices"][0]["text"] != ""
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            evs, done = collect(resp)
        assert done and "".join(e.json["choices"][0]["text"] for e in evs) == a["choices"][0]["text"]
        refused = http.post("/v1/completions", json={**body, "regex": "[0-9]+"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "grammar"
