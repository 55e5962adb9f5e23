"""What an SRE reads: one request's id in the API's and the worker's JSON logs, metrics in the
conventions people graph (vLLM's names, `spool_` prefix) on the API, worker and dispatcher, and an
API with two processes whose counters are the sum over both."""

from __future__ import annotations

import json
import re
import uuid

import httpx

from tests.conftest import MODEL, free_port, wait_for
from tests.helpers import two_process_api


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_a_request_id_ties_the_api_and_worker_logs_of_a_job(stack):
    rid = "req-" + uuid.uuid4().hex
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 3},
            headers={"x-request-id": rid},
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        job_id = r.json()["id"]
        minted = http.get("/v1/models").headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", minted)  # none sent: one is made
        bad = http.get("/v1/models", headers={"x-request-id": "no spaces; allowed"}).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", bad)  # not echoed: a made one instead
    with httpx.Client(base_url=stack.base_url) as anon:
        assert "x-request-id" in anon.get("/v1/models").headers  # errors (401 here) carry one too

    def logged() -> tuple[list[dict], list[dict]] | None:
        api = [e for e in _json_lines(stack.log("api")) if e.get("request_id") == rid]
        worker = [e for e in _json_lines(stack.log(stack.worker_name)) if e.get("request_id") == rid]
        # The access line is the request's last: waiting for it (not any line) leaves no race.
        has_access = any(e.get("logger") == "spool.access" for e in api)
        return (api, worker) if has_access and worker else None

    api, worker = wait_for(logged, 20, "log lines with the request id")
    access = [e for e in api if e.get("logger") == "spool.access"]
    assert access and access[0]["path"] == "/v1/completions" and access[0]["status"] == 200
    assert all(e.get("job_id") == job_id and e.get("model") == MODEL and e.get("attempt") == 1 for e in worker)
    everything = stack.log("api") + stack.log(stack.worker_name)
    assert stack.keys["alpha"] not in everything  # keys are never logged
    assert "Hello" not in "".join(json.dumps(e) for e in api + worker)  # nor prompts


def test_metrics_on_api_worker_and_dispatcher_have_sane_values(stack):
    with stack.http(stack.keys["beta"]) as http:
        for i in range(3):
            body = {"model": MODEL, "prompt": f"Count {i}:", "max_tokens": 8, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                resp.read()
    with stack.http(stack.keys["admin"]) as admin:
        api = admin.get("/metrics").text
    assert _metric(api, "spool_requests_admitted_total", model=MODEL) >= 3

    worker = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['worker']}/metrics").text
    assert _metric(worker, "spool_time_to_first_token_seconds_count", model=MODEL) >= 3
    assert _metric(worker, "spool_inter_token_latency_seconds_count", model=MODEL) >= 3 * 7
    assert _metric(worker, "spool_e2e_request_latency_seconds_count", model=MODEL) >= 3
    assert _metric(worker, "spool_request_queue_time_seconds_count", model=MODEL) >= 3
    assert _metric(worker, "spool_generation_tokens_total", model=MODEL) >= 24
    assert _metric(worker, "spool_prompt_tokens_total", model=MODEL) >= 3
    ttft_sum = _metric(worker, "spool_time_to_first_token_seconds_sum", model=MODEL)
    assert 0 < ttft_sum / _metric(worker, "spool_time_to_first_token_seconds_count", model=MODEL) < 30
    assert "spool_num_requests_running{" in worker and "spool_num_requests_waiting{" in worker

    def dispatcher() -> str | None:
        text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['dispatcher']}/metrics").text
        return text if _metric(text, "spool_live_workers", model=MODEL) >= 1 else None

    text = wait_for(dispatcher, 15, "dispatcher gauges")
    assert "spool_queue_depth{" in text and "spool_oldest_queued_job_age_seconds{" in text
    # Reported per model and kind, and 0 with nothing waiting (every request above has ended).
    ages = re.findall(
        rf'^spool_oldest_queued_job_age_seconds{{[^}}]*model="{MODEL}"[^}}]*kind="interactive"[^}}]*}} (\S+)$|'
        rf'^spool_oldest_queued_job_age_seconds{{[^}}]*kind="interactive"[^}}]*model="{MODEL}"[^}}]*}} (\S+)$',
        text,
        re.M,
    )
    assert len(ages) == 1 and float("".join(ages[0])) == 0.0, ages


def test_with_two_api_processes_the_counters_are_the_sum(stack):
    metrics_port = free_port()
    with two_process_api(stack, SPOOL_API_METRICS_PORT=str(metrics_port)) as base:
        headers = {"Authorization": f"Bearer {stack.keys['ops']}"}
        n = 12
        for i in range(n):  # new connections: both processes take some
            with httpx.Client(base_url=base, headers=headers, timeout=60) as c:
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 1})
                assert r.status_code == 200, r.text
        tenant = str(_tenant_id(stack, "ops"))
        admin = {"Authorization": f"Bearer {stack.keys['admin']}"}
        for _ in range(4):  # whichever process answers the scrape, it reports the sum
            with httpx.Client(base_url=base, headers=admin, timeout=30) as c:
                text = c.get("/metrics").text
            assert _metric(text, "spool_requests_admitted_total", tenant=tenant, model=MODEL) == n
        # The private metrics port (one of the two processes bound it) reports the same sum, no key needed.
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        assert _metric(text, "spool_requests_admitted_total", tenant=tenant, model=MODEL) == n


def _tenant_id(stack, name: str) -> int:
    with stack.http(stack.keys["admin"]) as admin:
        return next(t["id"] for t in admin.get("/admin/tenants").json()["data"] if t["name"] == name)
