"""Prefer: respond-async, polling, and the replayable events endpoint (with Last-Event-ID)."""

from __future__ import annotations

from tests.conftest import wait_for
from tests.helpers import submit_async
from tests.sse import collect


def _submit(http, **body):
    body = {"prompt": "The three primary colors are", "max_tokens": 20, "temperature": 0.5, "seed": 5, **body}
    job = submit_async(http, **body)
    assert job["status"] in ("queued", "dispatched", "running")
    return job["id"]


def _poll_done(http, job_id):
    return wait_for(
        lambda: (j := http.get(f"/v1/jobs/{job_id}").json())["status"] == "succeeded" and j,
        60,
        f"job {job_id} succeeded",
    )


def test_async_poll_then_replay_from_start_and_from_last_event_id(stack):
    with stack.http(stack.keys["alpha"]) as http:
        job_id = _submit(http, n=2)
        job = _poll_done(http, job_id)
        result = job["result"]
        assert [c["index"] for c in result["choices"]] == [0, 1]
        assert job["usage"]["completion_tokens"] > 0

        with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            assert resp.headers["content-type"].startswith("text/event-stream"), resp.read()
            evs, done = collect(resp)
        assert done
        chunks = [e.json for e in evs]
        texts = {0: "", 1: ""}
        for c in chunks:
            for ch in c["choices"]:
                texts[ch["index"]] += ch["text"]
        assert texts == {c["index"]: c["text"] for c in result["choices"]}
        assert chunks[-1]["usage"] == job["usage"]

        # Resume after the k-th event: exactly the rest, nothing missing, nothing doubled.
        ids = [e.id for e in evs]
        assert all(ids) and len(set(ids)) == len(ids)
        for k in (0, len(evs) // 2, len(evs) - 2):
            with http.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": ids[k]}) as resp:
                rest, done = collect(resp)
            assert done
            assert [e.id for e in rest] == ids[k + 1 :]
            assert [e.data for e in rest] == [e.data for e in evs[k + 1 :]]


def test_events_stream_attaches_while_running(stack):
    with stack.http(stack.keys["alpha"]) as http:
        job_id = _submit(http, max_tokens=48, ignore_eos=True)
        with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            evs, done = collect(resp)
        assert done
        job = http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded"
        streamed = "".join(c["text"] for e in evs for c in e.json["choices"])
        assert streamed == job["result"]["choices"][0]["text"]
        assert job["usage"]["completion_tokens"] == 48


def test_cancel(stack, db, rds):
    with stack.http(stack.keys["alpha"]) as http:
        job_id = _submit(http, max_tokens=600, ignore_eos=True)
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 30, "running")
        r = http.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        again = http.post(f"/v1/jobs/{job_id}/cancel")
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
        with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            evs, done = collect(resp)
        assert done and evs[-1].json["error"]["code"] == "cancelled"
        # The worker let go: within its cancel poll (0.5 s) it drops the job's sequences (and says so)...
        import time

        from core.infra.streams import write

        ended = ("dropping its sequences", "lost its lease", "superseded", "let go")  # workers/: how an attempt stops

        def let_go() -> bool:
            lines = stack.log(stack.worker_name).splitlines()
            return any(job_id in x and any(e in x for e in ended) for x in lines)

        wait_for(let_go, 30, "the worker to let the job go")
        before = len(write.entries(rds, job_id))
        time.sleep(2)  # ...and publishes nothing more: only time passing can show that
        assert len(write.entries(rds, job_id)) == before, "the worker kept generating a cancelled job"
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"


def test_other_tenants_job_is_not_found(stack):
    with stack.http(stack.keys["alpha"]) as alpha, stack.http(stack.keys["beta"]) as beta:
        job_id = _submit(alpha, max_tokens=2)
        for method, path in (
            ("GET", f"/v1/jobs/{job_id}"),
            ("GET", f"/v1/jobs/{job_id}/events"),
            ("POST", f"/v1/jobs/{job_id}/cancel"),
        ):
            r = beta.request(method, path)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["code"] == "job_not_found"
        assert _poll_done(alpha, job_id)["status"] == "succeeded"
