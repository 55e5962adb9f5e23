"""A request waiting for its answer when its API process is told to stop (a rolling restart).

uvicorn gives in-flight requests `--timeout-graceful-shutdown` seconds and then cancels them, which
answered 500 to every non-streamed request still waiting (seen in the fault harness's API SIGTERM).
Now a waiting request is answered at once with 503 + Retry-After, the job goes on, and the same
request again (the openai SDK retries a 503 with the same Idempotency-Key) gets that job's answer
from another API process."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid

import httpx
import openai

from tests.conftest import MODEL, ROOT, SPOOL, free_port, wait_for


def test_sigterm_answers_waiting_requests_503_and_the_retry_gets_the_job(stack):
    since = _sql(stack, "SELECT now()")
    port = free_port()
    log = open(stack.logdir / "api-drain.log", "ab")
    api = subprocess.Popen(
        [*SPOOL, "api"], env={**stack.env, "SPOOL_API_PORT": str(port)}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    worker = stack.procs["worker"]
    key = uuid.uuid4().hex
    body = {"model": MODEL, "prompt": "Drain test: once upon a time", "max_tokens": 24, "temperature": 0}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "Idempotency-Key": key}
    try:
        wait_for(lambda: _up(port), 60, "the second API")
        os.kill(worker.pid, signal.SIGSTOP)  # the job cannot finish: the request is still waiting
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120) as c:
            answer: list[httpx.Response] = []
            t = threading.Thread(target=lambda: answer.append(c.post("/v1/completions", json=body)))
            t.start()
            wait_for(lambda: _job_for(stack, key), 30, "the job stored")
            api.send_signal(signal.SIGTERM)
            t.join(60)
        r = answer[0]
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "server_restarting" and "Idempotency-Key" in err["message"]
        stored = _job_for(stack, key)  # named, so that a client without a key can read it instead
        assert r.headers["x-spool-job-id"] == stored and r.headers["location"] == f"/v1/jobs/{stored}"
        api.wait(30)
        # It drained instead of having uvicorn cancel the waiting request at its shutdown timeout.
        assert "Exception in ASGI application" not in (stack.logdir / "api-drain.log").read_text(errors="replace")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        if api.poll() is None:
            api.kill()
    job_id = _job_for(stack, key)
    sdk = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.keys["alpha"], max_retries=0)
    done = sdk.completions.create(
        model=MODEL, prompt=body["prompt"], max_tokens=24, temperature=0, extra_headers={"Idempotency-Key": key}
    )
    assert done.id == job_id  # the same job, not a second one
    assert done.usage is not None and done.usage.completion_tokens == 24
    q = "SELECT count(*) FROM jobs j JOIN tenants t ON t.id = j.tenant_id WHERE t.name = 'alpha' AND j.created_at >= :t"
    assert _sql(stack, q, t=since) == 1


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _sql(stack, query: str, **params):
    from sqlalchemy import create_engine, text

    eng = create_engine(stack.env["SPOOL_DATABASE_URL"])
    try:
        with eng.connect() as conn:
            return conn.scalar(text(query), params)
    finally:
        eng.dispose()


def _job_for(stack, key: str) -> str | None:
    return _sql(stack, "SELECT object_id FROM idempotency_keys WHERE key = :k", k=key)
