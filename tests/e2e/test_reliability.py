"""Exactly one result per job: duplicate deliveries are no-ops, a killed worker's job is resumed."""

from __future__ import annotations

import json
import threading

import pytest
from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.generation.params import GenerationParams
from core.infra.broker import RUN_JOB, queue_for
from core.infra.orm import Tenant
from core.infra.streams import keys
from core.infra.tokenizers import tokenizer_for
from core.jobs import transitions as jobs
from tests.conftest import MODEL, TEST_REDIS, job_row, wait_for
from tests.helpers import submit_async
from tests.sse import collect

# wallclock: waits out a lease and the dispatcher's re-send (24 s of wall, 12 s of CPU in a shard)
# ops/test.sh runs it beside the CPU-bound shards.
pytestmark = pytest.mark.wallclock


def _deltas(rds, job_id):
    evs = (json.loads(keys.payload(f)) for _, f in rds.xrange(keys.stream_key(job_id)))
    return [e for e in evs if e["type"] == "delta"]


def _insert_job(db, *, dispatched: bool, prompt: str = "Twice:") -> str:
    """A job row written straight to the ledger, as the API would, but with no message sent."""
    params = GenerationParams(max_tokens=16, temperature=0.7, seed=99, ignore_eos=True)
    with Session(db) as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "alpha"))
        ids = tokenizer_for(MODEL).encode(prompt)
        job = jobs.new_job(
            tenant_id=tenant_id,
            model=MODEL,
            params=params.to_json(),
            prompts=[{"ids": ids, "text": prompt}],
            stream=False,
        )
        s.add(job)
        s.commit()
        job_id = job.id
        if dispatched:
            assert s.execute(jobs.mark_dispatched(job_id, 1)).first() is not None
            s.commit()
    return job_id


def test_queued_job_without_message_is_sent_by_the_dispatcher(stack, db):
    job_id = _insert_job(db, dispatched=False, prompt="Queued:")
    wait_for(lambda: job_row(db, job_id)["state"] == "succeeded", 30, "dispatcher to send it")


def test_lost_message_is_resent_after_the_dispatch_timeout(stack, db):
    job_id = _insert_job(db, dispatched=True, prompt="Lost:")  # dispatched, but the message never left
    wait_for(lambda: job_row(db, job_id)["state"] == "succeeded", 60, "the re-send")
    assert job_row(db, job_id)["attempt"] == 1


def test_same_message_delivered_twice_yields_one_result(stack, db, rds):
    job_id = _insert_job(db, dispatched=True)

    broker = Celery(broker=TEST_REDIS)
    for _ in range(2):  # the same task, same attempt, delivered twice
        broker.send_task(RUN_JOB, args=[job_id, 1], queue=queue_for(MODEL))

    wait_for(lambda: job_row(db, job_id)["state"] == "succeeded", 60, "succeeded")
    skipped = f"job {job_id} attempt 1: not claimable"
    wait_for(lambda: stack.log(stack.worker_name).count(skipped) == 1, 20, "the duplicate to be skipped")
    row = job_row(db, job_id)
    assert row["usage"]["completion_tokens"] == 16
    evs = [json.loads(keys.payload(f)) for _, f in rds.xrange(keys.stream_key(job_id))]
    assert [e["type"] for e in evs].count("done") == 1
    deltas = [e for e in evs if e["type"] == "delta"]
    assert sum(len(e["token_ids"]) for e in deltas) == 16
    assert "".join(e["text"] for e in deltas) == row["result"]["choices"][0]["text"]


def test_killed_worker_job_is_requeued_and_finished_seamlessly(stack, db, rds):
    key = stack.keys["alpha"]
    n_tokens = 400
    with stack.http(key) as http:
        prompt = "A long story about a lighthouse keeper:"
        job = submit_async(http, prompt=prompt, max_tokens=n_tokens, temperature=0.8, seed=21, ignore_eos=True)
        job_id = job["id"]

        # A client following the stream across the crash.
        seen: dict = {}

        def follow():
            with stack.http(key) as h, h.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
                seen["events"], seen["done"] = collect(resp)

        reader = threading.Thread(target=follow)
        reader.start()

        wait_for(lambda: sum(len(d["token_ids"]) for d in _deltas(rds, job_id)) >= 40, 60, "40 tokens streamed")
        stack.kill_worker()
        before = sum(len(d["token_ids"]) for d in _deltas(rds, job_id))
        assert before < n_tokens, "the job finished before the kill; make it longer"
        assert job_row(db, job_id)["state"] == "running"

        stack.start_worker()
        wait_for(lambda: job_row(db, job_id)["state"] in ("succeeded", "failed"), 120, "job to finish")
        reader.join(60)

    row = job_row(db, job_id)
    assert row["state"] == "succeeded", row["error"]
    assert row["attempt"] == 2
    deltas = _deltas(rds, job_id)
    assert {d["attempt"] for d in deltas} == {1, 2}
    # Attempt 2 continued from attempt 1's tokens: nothing regenerated, nothing doubled.
    assert sum(len(d["token_ids"]) for d in deltas) == n_tokens == row["usage"]["completion_tokens"]
    text = row["result"]["choices"][0]["text"]
    assert "".join(d["text"] for d in deltas) == text
    assert seen["done"]
    assert "".join(c["text"] for e in seen["events"] for c in e.json["choices"]) == text
