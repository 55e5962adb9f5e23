"""Tenants and limits against real processes: shared limits across API replicas, token
reservations settled and released, revocation, isolation, usage."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.conftest import MODEL, wait_for
from tests.helpers import api_replica, submit_async

CHAT_DONE = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\nOK."  # greedy: ends right away


def _post(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": CHAT_DONE, "temperature": 0, **body})


def _long_story(http: httpx.Client) -> str:
    """The id of an async job of 400 tokens, which holds its reservation while it runs."""
    return submit_async(http, prompt="Tell me a long story.", max_tokens=400, ignore_eos=True)["id"]


@pytest.fixture(scope="module")
def replica2(stack):
    url, proc = api_replica(stack, "api2")
    yield url
    proc.terminate()


def test_two_replicas_share_one_rpm_limit(stack, replica2):
    key = stack.new_tenant("rpm5", rpm=5)
    headers = {"Authorization": f"Bearer {key}", "Prefer": "respond-async"}
    with (
        httpx.Client(base_url=stack.base_url, headers=headers) as one,
        httpx.Client(base_url=replica2, headers=headers) as two,
    ):
        replies = [_post(c, max_tokens=1) for c in (one, two, one, two, one)]
        assert [r.status_code for r in replies] == [202] * 5
        assert [r.headers["x-ratelimit-remaining-requests"] for r in replies] == ["4", "3", "2", "1", "0"]
        for client in (one, two):  # the 6th is refused whichever replica gets it
            r = _post(client, max_tokens=1)
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
            assert int(r.headers["retry-after"]) >= 1
            assert r.headers["x-ratelimit-limit-requests"] == "5"
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
            assert r.headers["x-ratelimit-reset-requests"]


def test_tpm_reservation_is_settled_to_real_usage(stack):
    key = stack.new_tenant("tpm400", tpm=400)
    with stack.http(key) as http:
        first = _post(http, max_tokens=300)
        assert first.status_code == 200, first.text
        used = first.json()["usage"]["total_tokens"]
        assert used < 60  # it stopped early: most of the reservation was not used
        reserved_left = int(first.headers["x-ratelimit-remaining-tokens"])
        assert reserved_left < 100  # prompt + 300 were reserved at admission
        # Without the refund this second reservation could not fit for many seconds.
        second = _post(http, max_tokens=300)
        assert second.status_code == 200, second.text
        assert int(second.headers["x-ratelimit-remaining-tokens"]) < 150
        assert _post(http, max_tokens=1000).status_code == 429  # more than the limit allows at all


def test_cancelled_and_failed_jobs_release_their_reservation(stack, db):
    key = stack.new_tenant("tpm500", tpm=500)
    with stack.http(key) as http:
        job_id = _long_story(http)
        assert _post(http, max_tokens=400).status_code == 429  # the running job holds the tokens
        assert http.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        ok = _post(http, max_tokens=400)
        assert ok.status_code == 200, ok.text


def test_revoked_key_is_refused_on_the_next_request(stack):
    key = stack.new_tenant("revokee")
    with stack.http(key) as http:
        assert _post(http, max_tokens=1).status_code == 200
        with stack.http(stack.keys["admin"]) as admin:
            keys = admin.get("/admin/tenants/revokee/keys").json()["data"]
            assert all("key" not in k for k in keys) and keys[0]["prefix"] == key[:16]
            assert admin.post(f"/admin/keys/{keys[0]['id']}/revoke").json()["revoked"] is True
        r = _post(http, max_tokens=1)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_max_queued_refuses_and_max_concurrent_holds_jobs_in_postgres(stack, db):
    key = stack.new_tenant("narrow", max_queued=3, max_concurrent=1)
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 60, "ignore_eos": True}
    with stack.http(key) as http:
        ids = []
        for _ in range(3):
            r = http.post("/v1/completions", headers={"Prefer": "respond-async"}, json=body)
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        r = http.post("/v1/completions", headers={"Prefer": "respond-async"}, json=body)
        assert r.status_code == 429 and r.json()["error"]["message"].startswith("Too many unfinished jobs")
        states = [http.get(f"/v1/jobs/{i}").json()["status"] for i in ids]
        assert states.count("queued") >= 1, states  # over the concurrency cap: waiting in Postgres
        running_at_once = 0

        def all_done() -> bool:  # sampled every 0.2 s: the most that were ever out at once
            nonlocal running_at_once, states
            states = [http.get(f"/v1/jobs/{i}").json()["status"] for i in ids]
            running_at_once = max(running_at_once, sum(s in ("dispatched", "running") for s in states))
            return all(s == "succeeded" for s in states)

        with contextlib.suppress(TimeoutError):  # the assertion below names the states
            wait_for(all_done, 90, "every job to succeed")
        assert all(s == "succeeded" for s in states), states
        assert running_at_once == 1
        assert http.post("/v1/completions", headers={"Prefer": "respond-async"}, json=body).status_code == 202


def test_admin_needs_an_admin_key_and_usage_is_per_tenant(stack):
    key = stack.new_tenant("metered")
    with stack.http(key) as http:
        for _ in range(2):
            assert _post(http, max_tokens=3, ignore_eos=True).status_code == 200
        assert http.get("/admin/tenants").status_code == 404  # an ordinary key learns nothing about /admin
        rows = http.get("/v1/usage").json()["data"]
        assert len(rows) == 1 and rows[0]["requests"] == 2 and rows[0]["model"] == MODEL
        assert rows[0]["prompt_tokens"] > 0 and rows[0]["completion_tokens"] > 0 and rows[0]["gpu_seconds"] > 0
    with stack.http(stack.keys["admin"]) as admin:
        all_rows = admin.get("/admin/usage").json()["data"]
        assert {r["tenant_id"] for r in all_rows} >= {rows[0]["tenant_id"]}
        assert len({r["tenant_id"] for r in all_rows}) > 1
        t = admin.patch("/admin/tenants/metered", json={"rpm": 100, "weight": 2}).json()
        assert (t["rpm"], t["weight"]) == (100, 2)
        assert admin.patch("/admin/tenants/metered", json={"rpm": None}).json()["rpm"] is None
        bad = admin.patch("/admin/tenants/metered", json={"weight": None})  # found by schemathesis: was a 500
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight"
    with stack.http(stack.keys["admin"]) as admin:
        metrics = admin.get("/metrics").text
    assert "spool_requests_admitted_total" in metrics


def test_metrics_answer_admin_keys_only(stack):
    """Issue 25: the API's metrics name every tenant's models, queues and errors: no key gets a 401,
    an ordinary key the same 404 as an unknown route, and neither sees a single metric line."""
    anonymous = httpx.get(stack.base_url + "/metrics")
    assert anonymous.status_code == 401 and "spool_" not in anonymous.text
    with stack.http(stack.keys["beta"]) as http:
        r = http.get("/metrics")
    assert r.status_code == 404 and "spool_" not in r.text
    assert r.json()["error"]["message"].startswith("Unknown request URL")
    with stack.http(stack.keys["admin"]) as admin:
        assert "spool_requests_admitted_total" in admin.get("/metrics").text


def test_tenant_b_gets_404_for_every_object_of_tenant_a(stack):
    """Every endpoint that names an object, with B's key on A's object: 404, shaped exactly like the
    404 for an id that does not exist (no leak through status, error code or param)."""
    import io
    import json

    a, b = stack.keys["alpha"], stack.keys["beta"]
    with stack.http(a) as http_a, stack.http(b) as http_b:
        job_id = http_a.post(
            "/v1/completions",
            headers={"Prefer": "respond-async"},
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
        ).json()["id"]
        line = json.dumps(
            {
                "custom_id": "1",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
            }
        )
        file_id = http_a.post(
            "/v1/files", files={"file": ("a.jsonl", io.BytesIO(line.encode()))}, data={"purpose": "batch"}
        ).json()["id"]
        batch_id = http_a.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        ).json()["id"]
        walk = [
            ("GET", "/v1/jobs/{job}", None),
            ("GET", "/v1/jobs/{job}/events", None),
            ("POST", "/v1/jobs/{job}/cancel", None),
            ("GET", "/v1/files/{file}", None),
            ("GET", "/v1/files/{file}/content", None),
            ("DELETE", "/v1/files/{file}", None),
            ("GET", "/v1/batches/{batch}", None),
            ("POST", "/v1/batches/{batch}/cancel", None),
            (
                "POST",
                "/v1/batches",
                {"input_file_id": "{file}", "endpoint": "/v1/completions", "completion_window": "24h"},
            ),
        ]
        ghosts = {"job": "cmpl-" + "0" * 24, "file": "file-" + "0" * 24, "batch": "batch_" + "0" * 24}
        real = {"job": job_id, "file": file_id, "batch": batch_id}
        for method, path, body in walk:
            answers = []
            for ids in (real, ghosts):
                url = path.format(**ids)
                payload = json.loads(json.dumps(body).replace("{file}", ids["file"])) if body else None
                r = http_b.request(method, url, json=payload)
                assert r.status_code == 404, (method, url, r.text)
                e = r.json()["error"]
                answers.append((e["type"], e["code"], e["param"]))
            assert answers[0] == answers[1], (method, path, answers)
        # B's usage lists B's rows only: both have some (A's job ended, B sent one of its own), so an
        # empty list cannot pass for isolation.
        assert _post(http_b, max_tokens=1).status_code == 200
        wait_for(lambda: http_a.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", 60, "A's job")
        with stack.http(stack.keys["admin"]) as admin:
            ids = {t["name"]: t["id"] for t in admin.get("/admin/tenants").json()["data"]}
        assert {r["tenant_id"] for r in http_a.get("/v1/usage").json()["data"]} == {ids["alpha"]}
        listed = [http_b.get(p).json()["data"] for p in ("/v1/files", "/v1/batches", "/v1/usage")]
        assert file_id not in [f["id"] for f in listed[0]] and batch_id not in [x["id"] for x in listed[1]]
        assert listed[2] and {r["tenant_id"] for r in listed[2]} == {ids["beta"]}, listed[2]
        # ...and A still sees all of it.
        assert http_a.get(f"/v1/jobs/{job_id}").status_code == 200
        assert http_a.get(f"/v1/files/{file_id}").status_code == 200
        assert http_a.get(f"/v1/batches/{batch_id}").status_code == 200


def test_a_job_whose_worker_keeps_dying_releases_its_reservation(stack, db):
    """The reaper's last-attempt path: the job fails with worker_lost, bills what its stream carried
    (issue 24: as a cancel does), and the rest of its reservation comes back."""
    from sqlalchemy import text

    key = stack.new_tenant("tpm450", tpm=450)
    with stack.http(key) as http:
        job_id = _long_story(http)
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 30, "running")
        assert _post(http, max_tokens=400).status_code == 429
        # Make this the last allowed attempt: the worker's lease renewal (attempt-fenced) now fails,
        # so it drops the job like a dead worker would, and the lease lapses.
        with db.begin() as conn:
            conn.execute(text("UPDATE jobs SET attempt = 3 WHERE id = :i"), {"i": job_id})
        job = wait_for(lambda: (j := http.get(f"/v1/jobs/{job_id}").json())["status"] == "failed" and j, 60, "reaped")
        assert job["error"]["code"] == "worker_lost"
        (row,) = http.get("/v1/usage").json()["data"]
        billed = row["prompt_tokens"] + row["completion_tokens"]
        assert 0 < row["completion_tokens"] < 400  # what was streamed, not what was reserved
        prompt = len(http.post("/tokenize", json={"model": MODEL, "content": CHAT_DONE}).json()["tokens"])
        assert _post(http, max_tokens=450 - billed - prompt).status_code == 200  # the rest came back
