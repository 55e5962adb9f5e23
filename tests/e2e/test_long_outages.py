"""Outages longer than every cache and retry window (issue 24): Postgres or Redis away for 30 s.

The key cache holds a principal for 5 s and redis-py retries for a few seconds; past those, a request
used to meet the outage while being authenticated, outside the routes' exception handlers, and got a
500. Every refused request must be a 503 with Retry-After for the whole outage (the openai SDK
retries those by itself), and a job stored before the outage still ends with its text.
`/v1/responses` (plain and `background`) is among the requests: refused the same way, and a refused
one stores nothing.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from ops.faults import OwnPostgres, OwnRedis
from tests.conftest import MODEL, Stack, running_stack, wait_for

# wallclock: its time is two 30 s outages; ops/test.sh runs it beside the rest
pytestmark = [
    pytest.mark.wallclock,
    pytest.mark.skipif(
        shutil.which("redis-server") is None
        or not list(__import__("pathlib").Path("/usr/lib/postgresql").glob("*/bin")),
        reason="needs redis-server and PostgreSQL's server binaries",
    ),
]

OUTAGE_S = 30.0


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> Iterator[tuple[Stack, OwnPostgres, OwnRedis]]:
    pg, r = OwnPostgres(tmp_path_factory.mktemp("pg")), OwnRedis(tmp_path_factory.mktemp("redis"))
    pg.init()
    r.start()
    try:
        with running_stack(tmp_path_factory.mktemp("long-outage-logs"), pg.url, r.url) as st:
            yield st, pg, r
    finally:
        r.kill()
        pg.stop("immediate")
        pg.remove()


def _requests(stack: Stack, keys: list[str]) -> list[tuple[str, httpx.Response, str | None]]:
    """One of every kind of request, for each key (cached or not); a response's tag (its `user`), by
    which the audit finds whatever it stored."""
    out: list[tuple[str, httpx.Response, str | None]] = []
    for key in keys:
        with stack.http(key) as http:
            http.timeout = httpx.Timeout(60)
            for what, extra in (("response", {}), ("response-bg", {"background": True})):
                tag = f"outage-{uuid.uuid4().hex}"
                body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "user": tag, **extra}
                out.append((what, http.post("/v1/responses", json=body), tag))
            rest: list[tuple[str, httpx.Response]] = []
            rest.append(
                ("completion", http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}))
            )
            rest.append(
                (
                    "chat",
                    http.post(
                        "/v1/chat/completions",
                        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                    ),
                )
            )
            rest.append(
                ("file", http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")}))
            )
            rest.append(
                (
                    "batch",
                    http.post(
                        "/v1/batches",
                        json={"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h"},
                    ),
                )
            )
            rest.append(("models", http.get("/v1/models")))
            rest.append(("jobs", http.get("/v1/files")))
            out += [(what, r, None) for what, r in rest]
    return out


Seen = tuple[float, str, int, str | None, str | None]  # (when, what, status, Retry-After, a response's tag)


def _through_outage(stack: Stack, keys: list[str], down, up) -> list[Seen]:
    """Send every kind of request every few seconds while a service is down for OUTAGE_S."""
    seen: list[Seen] = []
    down()
    started = time.monotonic()
    try:
        while time.monotonic() - started < OUTAGE_S:
            for what, r, tag in _requests(stack, keys):
                when = round(time.monotonic() - started, 1)
                seen.append((when, what, r.status_code, r.headers.get("retry-after"), tag))
                assert "Traceback" not in r.text and "127.0.0.1" not in r.text, r.text
            time.sleep(2)  # a round of requests every 2 s for as long as the outage lasts
    finally:
        up()
    return seen


def _wait_in_background(stack: Stack, key: str, out: dict) -> threading.Thread:
    """A JSON request that waits for its result; returns once its job is stored."""
    from sqlalchemy import create_engine, text

    engine = create_engine(stack.env["SPOOL_DATABASE_URL"])
    with engine.connect() as conn:
        before = conn.scalar(text("SELECT count(*) FROM jobs"))

    def run() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        with stack.http(key) as http:
            http.timeout = httpx.Timeout(300)
            r = http.post("/v1/completions", json=body)
            out["status"], out["body"] = r.status_code, r.json()

    t = threading.Thread(target=run)
    t.start()

    def stored() -> bool:
        with engine.connect() as conn:
            return conn.scalar(text("SELECT count(*) FROM jobs")) > before

    wait_for(stored, 30, "the job stored")
    engine.dispose()
    return t


def _check(seen: list[Seen]) -> None:
    refused = [s for s in seen if s[2] >= 500]
    assert refused, "the outage refused nothing: it did not happen"
    assert all(status == 503 and retry for _, _, status, retry, _ in refused), refused
    assert max(t for t, *_ in refused) > 10, "refusals must span past the 5 s key cache and redis-py's retries"
    # `/v1/responses`, plain and background, is refused as chat is, all through the outage.
    assert {"response", "response-bg"} <= {what for _, what, status, _, _ in refused}, refused


def _refused_stored_nothing(stack: Stack, seen: list[Seen]) -> None:
    """A refused response (503) stored no job: the SDK's retry would otherwise run it twice."""
    from sqlalchemy import create_engine, text

    tags = [tag for _, _, status, _, tag in seen if tag and status == 503]
    assert tags
    engine = create_engine(stack.env["SPOOL_DATABASE_URL"])
    with engine.connect() as conn:
        stored = conn.execute(text('SELECT "user" FROM jobs WHERE "user" = ANY(:tags)'), {"tags": tags}).all()
    engine.dispose()
    assert not stored, stored


def test_postgres_away_for_30s_is_503_with_retry_after_everywhere(own):
    stack, pg, _ = own
    fresh = stack.new_tenant("fresh-pg")  # never used before the outage: not in any cache
    out: dict = {}
    wait_for(lambda: httpx.get(stack.base_url + "/ready", timeout=5).status_code == 200, 30, "ready")
    worker = _wait_in_background(stack, stack.keys["alpha"], out)
    seen = _through_outage(stack, [stack.keys["beta"], fresh], lambda: pg.stop("immediate"), pg.start)
    _check(seen)
    worker.join(300)
    assert out.get("status") == 200, out  # stored before the outage, answered after it
    assert out["body"]["usage"]["completion_tokens"] == 60
    wait_for(lambda: httpx.get(stack.base_url + "/ready", timeout=5).status_code == 200, 60, "ready again")
    _refused_stored_nothing(stack, seen)
    with stack.http(fresh) as http:
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_redis_away_for_30s_is_503_with_retry_after_everywhere(own):
    stack, _, redis = own
    fresh = stack.new_tenant("fresh-redis")
    seen = _through_outage(stack, [stack.keys["beta"], fresh], redis.kill, redis.start)
    _check(seen)
    wait_for(lambda: httpx.get(stack.base_url + "/ready", timeout=5).status_code == 200, 60, "ready again")
    _refused_stored_nothing(stack, seen)
    with stack.http(fresh) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
