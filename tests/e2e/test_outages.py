"""Infrastructure faults on a stack with a Redis of its own, so the test may kill it: an outage costs
latency, never a job, a cancelled stream, a wrong text or a 5xx."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from ops.faults import OwnRedis
from tests.conftest import MODEL, TEST_DB, Stack, running_stack, wait_for
from tests.sse import events

# wallclock: its time is Redis held away; ops/test.sh runs it beside the rest
pytestmark = [
    pytest.mark.wallclock,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


@pytest.fixture(scope="module")
def outage(tmp_path_factory) -> Iterator[tuple[Stack, OwnRedis]]:
    r = OwnRedis(tmp_path_factory.mktemp("redis"))
    r.start()
    try:
        db_url = TEST_DB.rsplit("/", 1)[0] + "/spool_outage"
        with running_stack(tmp_path_factory.mktemp("outage-logs"), db_url, r.url) as st:
            yield st, r
    finally:
        r.kill()


def _follow(stack: Stack, key: str, out: dict, i: int, under_way: threading.Event) -> None:
    body = {
        "model": MODEL,
        "prompt": f"Story {i}:",
        "max_tokens": 80,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    got, job = "", None
    with stack.http(key) as http, http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for ev in events(resp):
            if ev.data == "[DONE]":
                out[i] = (job, got, True)
                return
            chunk = ev.json
            assert "error" not in chunk, chunk
            job = chunk["id"]
            got += chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if got:
                under_way.set()
    out[i] = (job, got, False)


def test_redis_killed_and_restarted_empty_mid_stream(outage):
    stack, redis = outage
    key = stack.keys["alpha"]
    out: dict[int, tuple] = {}
    under_way = [threading.Event() for _ in range(6)]
    threads = [threading.Thread(target=_follow, args=(stack, key, out, i, under_way[i])) for i in range(6)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in under_way), "a stream got no text before the outage"
    redis.kill()
    time.sleep(3)  # the outage itself: Redis stays away this long
    redis.start()  # empty: every stream, queue and limit is gone
    for t in threads:
        t.join(240)
    engine = create_engine(stack.env["SPOOL_DATABASE_URL"])
    with engine.connect() as conn:
        for i in range(6):
            job_id, got, done = out[i]
            row = conn.execute(text("SELECT state, result FROM jobs WHERE id = :i"), {"i": job_id}).one()
            assert row.state == "succeeded", (i, row.state)  # never cancelled, never failed
            assert done and got == row.result["choices"][0]["text"], i  # nothing missing, nothing twice
    engine.dispose()
    # Workers re-announce themselves within a heartbeat (Redis lost their entries: until then a
    # waiting request is a 503 with Retry-After, never a hang); then, with the pooled connections
    # that died with Redis replaced, requests are answered.
    import httpx

    wait_for(lambda: httpx.get(stack.base_url + "/ready", timeout=5).status_code == 200, 15, "ready again")
    with stack.http(key) as http:
        for _ in range(3):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
