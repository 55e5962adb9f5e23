"""Durability against clients and faults that are not a worker crash: hostile bodies, clients that
leave and come back, tokens read then cancelled, many readers, lost messages under a backlog."""

from __future__ import annotations

import json
import socket

import httpx
from sqlalchemy import text

from core.infra.broker import queued_jobs
from tests.conftest import MODEL, TEST_REDIS, job_row, wait_for
from tests.sse import collect, events


def _raw_post(stack, headers: dict[str, str], chunks, chunk_size: int = 1 << 20) -> tuple[int, int]:
    """POST a chunked body, a chunk at a time, until the server answers; returns (status, bytes sent)."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n{head}\r\n".encode()
        )
        sent = 0
        sock.settimeout(0.05)
        for _ in range(chunks):
            block = b"x" * chunk_size
            try:
                sock.sendall(f"{len(block):x}\r\n".encode() + block + b"\r\n")
            except OSError:
                break  # the server answered and closed: it stopped reading
            sent += len(block)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except (TimeoutError, BlockingIOError):
                continue
        sock.settimeout(30)
        reply = b""
        while b"\r\n" not in reply:
            part = sock.recv(4096)
            if not part:
                break
            reply += part
    return int(reply.split(b" ")[1]), sent


def test_an_anonymous_body_is_refused_before_it_is_read(stack):
    status, sent = _raw_post(stack, {}, chunks=64)  # would be 64 MiB
    assert status == 401
    assert sent < 8 << 20, f"the API read {sent} bytes of an unauthenticated body"


def test_a_chunked_body_past_the_limit_is_cut_off_with_413(stack, db):
    before = db.connect().execute(text("SELECT count(*) FROM jobs")).scalar()
    status, sent = _raw_post(stack, {"Authorization": f"Bearer {stack.keys['alpha']}"}, chunks=64)
    assert status == 413
    assert sent <= 12 << 20, f"{sent} bytes went in before the 413 (limit 8 MiB)"
    assert db.connect().execute(text("SELECT count(*) FROM jobs")).scalar() == before


def _stream_some(http: httpx.Client, n_chunks: int, **body) -> tuple[str, str, str]:
    """Start a streaming completion, read n chunks, drop the connection. Returns (job id, last id, text)."""
    req = {"model": MODEL, "prompt": "Tell me a long story.", "stream": True, "ignore_eos": True, **body}
    text_so_far, last_id, job_id = "", "", ""
    with http.stream("POST", "/v1/completions", json=req) as resp:
        assert resp.status_code == 200
        for ev in events(resp):
            chunk = ev.json
            job_id, last_id = chunk["id"], ev.id or last_id
            text_so_far += chunk["choices"][0]["text"]
            n_chunks -= 1
            if n_chunks <= 0:
                break
    return job_id, last_id, text_so_far


def test_a_client_that_reattaches_within_the_grace_period_keeps_its_job(stack, db):
    with stack.http(stack.keys["alpha"]) as http:
        job_id, last_id, first = _stream_some(http, 3, max_tokens=60, temperature=0)
        with http.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_id}) as resp:
            evs, done = collect(resp)
        assert done
        rest = "".join(e.json["choices"][0]["text"] for e in evs if e.json.get("choices"))
    row = job_row(db, job_id)
    assert row["state"] == "succeeded"
    assert first + rest == row["result"]["choices"][0]["text"]  # nothing missing, nothing twice


def test_a_client_that_leaves_for_good_is_cancelled_after_the_grace_period(stack, db):
    with stack.http(stack.keys["alpha"]) as http:
        job_id, _, _ = _stream_some(http, 2, max_tokens=600)
    wait_for(lambda: job_row(db, job_id)["state"] == "cancelled", 20, "the abandoned job cancelled")


def test_tokens_read_before_a_cancel_are_billed(stack, db):
    key = stack.new_tenant("billed")
    with stack.http(key) as http:
        job_id, _, seen = _stream_some(http, 20, max_tokens=600)
        assert http.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        wait_for(lambda: http.get("/v1/usage").json()["data"], 10, "a usage row")
        usage = http.get("/v1/usage").json()["data"][0]
    assert seen and usage["completion_tokens"] >= 20, usage  # at least what the client read
    assert usage["prompt_tokens"] > 0


def test_a_thousand_event_readers_on_one_api_process(stack, db):
    """1,000 open event streams on one API process with its default pool (60 Postgres connections):
    every reader gets the whole job, and ordinary requests are still answered meanwhile. The job waits
    behind another of its tenant's (concurrency cap 1) until all readers are attached."""
    import asyncio

    n = 1000
    key = stack.new_tenant("crowd", max_concurrent=1)
    body = {"model": MODEL, "ignore_eos": True, "temperature": 0}
    with stack.http(key) as http:
        async_ = {"Prefer": "respond-async"}
        blocker = http.post("/v1/completions", json={**body, "prompt": "Wait:", "max_tokens": 1000}, headers=async_)
        r = http.post("/v1/completions", json={**body, "prompt": "Count:", "max_tokens": 120}, headers=async_)
        blocker_id, job_id = blocker.json()["id"], r.json()["id"]
    open_now = peak = 0
    all_open = asyncio.Event()

    async def read(client: httpx.AsyncClient) -> str:
        nonlocal open_now, peak
        text, done = "", False
        async with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            assert resp.status_code == 200
            open_now += 1
            peak = max(peak, open_now)
            if open_now == n:
                all_open.set()
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk.get("choices", []))
        open_now -= 1
        assert done
        return text

    async def main() -> tuple[set[str], list[int]]:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=stack.base_url, headers=headers, limits=limits, timeout=300) as c:
            readers = [asyncio.create_task(read(c)) for _ in range(n)]
            await asyncio.wait([asyncio.create_task(all_open.wait()), *readers], return_when=asyncio.FIRST_COMPLETED)
            statuses = [
                (await c.get("/v1/models")).status_code,
                (await c.get(f"/v1/jobs/{job_id}")).status_code,
                (await c.get("/v1/usage")).status_code,
            ]
            assert (await c.get(f"/v1/jobs/{job_id}")).json()["status"] in ("queued", "dispatched")
            await c.post(f"/v1/jobs/{blocker_id}/cancel")  # now the job runs, to 1,000 readers
            return set(await asyncio.gather(*readers)), statuses

    texts, statuses = asyncio.run(main())
    assert peak == n  # all of them were open at once
    assert statuses == [200, 200, 200]  # ordinary requests answered while 1,000 streams were open
    assert texts == {job_row(db, job_id)["result"]["choices"][0]["text"]}


def test_a_lost_message_is_resent_even_while_the_queue_is_busy(stack, db):
    """Messages wait in the queue (no worker), and a job marked dispatched has no message at all:
    the dispatcher re-sends exactly that one, without duplicating the waiting ones."""
    import redis as redis_lib

    broker = redis_lib.Redis.from_url(TEST_REDIS)
    stack.kill_worker()
    try:
        with stack.http(stack.keys["alpha"]) as http:
            waiting = [
                http.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                    headers={"Prefer": "respond-async"},
                ).json()["id"]
                for _ in range(2)
            ]
            lost = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Lost", "max_tokens": 2},
                headers={"Prefer": "respond-async"},
            ).json()["id"]
        wait_for(lambda: {(w, 1) for w in [*waiting, lost]} <= queued_jobs(broker, MODEL), 10, "messages queued")
        # Lose the third message, as a broker restart or a dropped connection would.
        for q in (f"spool.model.{MODEL}.interactive",):
            for raw in broker.lrange(q, 0, -1):
                if lost.encode() in raw:
                    broker.lrem(q, 1, raw)
        with db.begin() as conn:
            conn.execute(text("UPDATE jobs SET dispatched_at = now() - interval '1 hour' WHERE id = :i"), {"i": lost})
        wait_for(lambda: (lost, 1) in queued_jobs(broker, MODEL), 30, "the lost message re-sent")
        queued = [json.loads(r) for r in broker.lrange(f"spool.model.{MODEL}.interactive", 0, -1)]
        assert len(queued) == 3, "a waiting message was duplicated"
    finally:
        stack.start_worker()
    for job_id in [*waiting, lost]:
        wait_for(lambda j=job_id: job_row(db, j)["state"] == "succeeded", 60, f"{job_id} done")


def _batch_errors(stack, content: bytes) -> list[dict]:
    client = stack.openai()
    import io

    f = client.files.create(file=("poison.jsonl", io.BytesIO(content)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(b.id).status != "validating", 60, "validation to end")
    b = client.batches.retrieve(b.id)
    assert b.status == "failed", b.status
    return [e.model_dump() for e in b.errors.data]


def _line(custom_id: str, **body) -> bytes:
    req = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": req}).encode()


def test_poison_lines_fail_the_batch_once_with_the_line_named(stack):
    bad_bias = _line("x", logit_bias={"99999999": 1})  # an id outside the vocabulary
    errors = _batch_errors(stack, _line("ok") + b"\n" + _line("bad\u0000id") + b"\n" + bad_bias)
    by_line = {e["line"]: e for e in errors}
    assert "NUL" in by_line[2]["message"]
    assert by_line[3]["param"] == "body.logit_bias"


def test_a_file_without_newlines_is_reported_not_loaded(stack):
    errors = _batch_errors(stack, _line("a") + b"\n" + b'{"custom_id": "' + b"y" * (9 << 20) + b'"}')
    assert [e["code"] for e in errors] == ["line_too_long"] and errors[0]["line"] == 2


def test_logit_bias_with_a_non_ascii_digit_is_a_text_not_a_crash(stack):
    # int("²") raises; such a key is a text, tokenized (llama.cpp's form), and an id out of range a 400.
    with stack.http(stack.keys["alpha"]) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "logit_bias": {"²": 1}})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logit_bias": {"99999999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_a_tenant_cannot_keep_more_files_than_its_storage_quota(stack):
    key = stack.new_tenant("hoarder", max_storage_bytes=2500)
    line = (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}) + "\n").encode()
    with stack.http(key) as http:

        def upload(n_lines: int) -> httpx.Response:
            return http.post("/v1/files", files={"file": ("f.jsonl", line * n_lines)}, data={"purpose": "batch"})

        first = upload(20)  # 1.5 kB of 2.5 kB
        assert first.status_code == 200, first.text
        refused = upload(20)
        assert refused.status_code == 413
        assert refused.json()["error"]["code"] == "storage_quota_exceeded"
        listed = http.get("/v1/files").json()["data"]
        assert [f["id"] for f in listed] == [first.json()["id"]]  # the refused upload left nothing behind
        assert http.delete(f"/v1/files/{first.json()['id']}").status_code == 200
        assert upload(20).status_code == 200  # deleted files no longer count
