"""Text Postgres's JSONB cannot hold (a NUL character) in what a job returns: the echoed prompt and
the generated text. The client read every token before the final write, so that write must not
fail: the job succeeds, its stored result (polled) is exactly what was streamed, and usage counts
it. SmolLM2's vocabulary is byte-level: token 190 is the single byte 0x00."""

from __future__ import annotations

from tests.conftest import MODEL, wait_for
from tests.helpers import tenant_rows
from tests.sse import collect

NUL_TOKEN = 190


def _stream(http, body: dict) -> tuple[str, str, dict, list]:
    """(job id, streamed text, usage, streamed token texts) of one streamed completion."""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        evs, done = collect(resp)
    assert done
    chunks = [e.json for e in evs]
    assert not [c for c in chunks if "error" in c], chunks
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    tokens = [t for c in chunks if c.get("choices") for t in (c["choices"][0].get("logprobs") or {}).get("tokens", [])]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    return chunks[0]["id"], streamed, usage, tokens


def _polled(http, job_id: str) -> dict:
    return wait_for(
        lambda: (j := http.get(f"/v1/jobs/{job_id}").json())["status"] not in ("queued", "dispatched", "running") and j,
        60,
        f"job {job_id} ended",
    )


def _usage_row(db, tenant: str) -> tuple[int, int, int, int]:
    sums = ", ".join(f"sum(x.{c}) AS {c}" for c in ("requests", "failed", "prompt_tokens", "completion_tokens"))
    (row,) = tenant_rows(db, tenant, "usage_daily", sums)
    return tuple(row.values())


def test_an_echoed_nul_is_stored_exactly_and_the_job_succeeds(stack, db):
    key = stack.new_tenant("nul-echo")
    prompt = [19556, NUL_TOKEN, 905, NUL_TOKEN]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "echo": True,
        "logprobs": 1,
        "max_tokens": 4,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    with stack.http(key) as http:
        job_id, streamed, usage, tokens = _stream(http, body)
        assert streamed.count("\x00") >= 2 and "\x00" in tokens  # the client got the NULs
        job = _polled(http, job_id)
    assert job["status"] == "succeeded", job["error"]
    choice = job["result"]["choices"][0]
    assert choice["text"] == streamed  # stored losslessly: the poll answers what the stream said
    assert choice["logprobs"]["tokens"][: len(prompt)].count("\x00") == 2
    assert job["usage"] == usage and usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] >= 1
    assert _usage_row(db, "nul-echo") == (1, 0, len(prompt), usage["completion_tokens"])


def test_a_generated_nul_is_stored_exactly_and_the_job_succeeds(stack, db):
    key = stack.new_tenant("nul-gen")
    body = {
        "model": MODEL,
        "prompt": "Say something:",
        "max_tokens": 3,
        "temperature": 0,
        "logit_bias": {str(NUL_TOKEN): 100},  # the model generates the NUL byte
        "stream_options": {"include_usage": True},
    }
    with stack.http(key) as http:
        job_id, streamed, usage, _ = _stream(http, body)
        assert streamed == "\x00\x00\x00"
        job = _polled(http, job_id)
        # A request that waits for its answer gets it too, instead of a failure after generating.
        r = http.post("/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "\x00\x00\x00"
    assert job["status"] == "succeeded", job["error"]
    assert job["result"]["choices"][0]["text"] == streamed
    assert usage["completion_tokens"] == 3 and job["usage"] == usage
    requests, failed, prompt_tokens, completion_tokens = _usage_row(db, "nul-gen")
    assert (requests, failed, prompt_tokens, completion_tokens) == (2, 0, 2 * usage["prompt_tokens"], 6)
