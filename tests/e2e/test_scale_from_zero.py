"""A model that may have no worker (`min_workers` 0, what an autoscaler scaling from zero needs): its
requests are stored and held for a worker up to `cold_wait_s`, streams kept alive meanwhile, instead of
a 503 at once; past the wait they fail with 503 `model_not_loaded`. The paced stack of
ops/bench/fairness.py with no worker, then one started as an autoscaler would."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from sqlalchemy import create_engine, text

from ops.bench import fairness
from ops.harness import side_redis, wait_for
from tests.conftest import MODEL, TEST_DB, running_stack

# The fairness module's Redis db: both run in the wallclock process, one module after the other.
pytestmark = pytest.mark.wallclock


@pytest.fixture(scope="module")
def cold_stack(tmp_path_factory):
    db = TEST_DB.rsplit("/", 1)[0] + "/spool_cold_e2e"
    env = {**fairness.STACK_ENV, "SPOOL_MIN_WORKERS": "0", "SPOOL_COLD_WAIT_S": "8"}
    with running_stack(tmp_path_factory.mktemp("cold-logs"), db, side_redis("fairness"), **env) as st:
        st.signal("worker", 15)  # SIGTERM: the worker leaves the live set on its way out
        wait_for(lambda: not st.ready(), 30, "the model without a worker")
        yield st, create_engine(db)


def _gauge(st, name: str) -> float | None:
    body = httpx.get(f"http://127.0.0.1:{st.metrics_ports['dispatcher']}/metrics").text
    m = re.search(rf'^{name}{{model="{MODEL}"}} ([0-9.e+-]+)$', body, re.M)
    return float(m.group(1)) if m else None


def test_a_request_is_held_until_a_worker_comes_up(cold_stack):
    st, _ = cold_stack
    out: dict[str, object] = {}

    def ask() -> None:
        client = st.openai("alpha")
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
        text_parts = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.setdefault("ttft", time.perf_counter() - t0)
                text_parts.append(chunk.choices[0].delta.content)
        out["text"] = "".join(text_parts)

    # A queued (async) request says what it waits for.
    with st.http(st.keys["alpha"]) as http:
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
            headers={"Prefer": "respond-async"},
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert http.get(f"/v1/jobs/{job_id}").json()["waiting_for"] == "worker"
    asker = threading.Thread(target=ask)
    asker.start()
    # Held, not refused: the dispatcher's gauges say so while no worker is live.
    wait_for(lambda: _gauge(st, "spool_requests_awaiting_worker") == 2.0, 20, "the requests held for a worker")
    assert _gauge(st, "spool_wanted_workers") == 1.0
    started = time.perf_counter()
    st.start_worker()  # the autoscaler's part
    up = time.perf_counter() - started
    asker.join(120)
    assert out.get("text"), out  # answered in full once the worker came
    with st.http(st.keys["alpha"]) as http:
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", 60, "the queued one ran")
        assert http.get(f"/v1/jobs/{job_id}").json()["waiting_for"] is None
    print(f"worker start {up:.2f} s; the held request's TTFT {out['ttft']:.2f} s")
    wait_for(lambda: _gauge(st, "spool_requests_awaiting_worker") == 0.0, 20, "nothing held any more")


def test_past_the_wait_a_held_request_is_a_503(cold_stack):
    st, db = cold_stack
    st.signal("worker", 15)
    wait_for(lambda: not st.ready(), 30, "the model without a worker again")
    try:
        with st.http(st.keys["alpha"]) as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=120)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_not_loaded"
        with db.connect() as conn:
            state = conn.execute(
                text("SELECT state FROM jobs WHERE id = :i"), {"i": r.headers["x-spool-job-id"]}
            ).scalar()
        assert state == "failed"  # ended like any job: billed as a failed request, its reservation settled
    finally:
        st.start_worker()
