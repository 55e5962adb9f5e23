"""SPOOL_ENGINE=null: the whole queue path with no model, for measuring the path itself."""

from __future__ import annotations

import json

import pytest

from ops.harness import side_redis
from tests.conftest import MODEL, TEST_DB, running_stack
from tests.sse import collect


@pytest.fixture(scope="module")
def null_stack(tmp_path_factory):
    db = TEST_DB.rsplit("/", 1)[0] + "/spool_null"
    with running_stack(tmp_path_factory.mktemp("null-logs"), db, side_redis("null_engine"), SPOOL_ENGINE="null") as st:
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


@pytest.mark.parametrize("stream", [True, False])
def test_spool_bench_measures_the_queue_path_streaming_or_not(null_stack, stream, tmp_path):
    """`spool bench` against the null stack, streamed and plain JSON (what the issue's jobs/s figure
    uses): every request completes with its one token, and the report has what each mode can measure."""
    out = tmp_path / "bench.json"
    null_stack.cli(
        "bench",
        "--url",
        null_stack.base_url,
        "--api-key",
        null_stack.keys["alpha"],
        "--model",
        MODEL,
        "--concurrency",
        "1,8",
        "--requests",
        "16",
        "--max-tokens",
        "1",
        "--stream" if stream else "--no-stream",
        "--json",
        str(out),
    )
    runs = json.loads(out.read_text())["summaries"]
    assert [(r["concurrency"], r["requests"], r["failed"], r["output_tokens"]) for r in runs] == [
        (1, 16, 0, 16),
        (8, 16, 0, 16),
    ]
    for r in runs:
        assert r["requests_s"] > 0 and r["e2e_ms"]["p50"] > 0
        assert bool(r["ttft_ms"]) == stream  # no first token to time in a JSON response
