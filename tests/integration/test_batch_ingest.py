"""A batch's lines become jobs through the one job-row builder (core/jobs/transitions.new_row): the
validator's COPY (core/batches/ingest.validate) stores each line as the row `new_row` builds for it,
with its batch columns, queued at attempt 1. Validated or rejected, the batch's lease is released and
its counts start from the file's lines (core/batches/transitions.py)."""

from __future__ import annotations

from sqlalchemy import select

from core.batches import ingest
from core.infra.orm import Batch, Job
from core.jobs import transitions
from core.states import BatchStatus, JobKind
from ops import factories

MODEL = "smollm2-135m-instruct"


def test_validated_lines_are_the_rows_new_row_builds(sessions, session, it_settings):
    t = factories.tenant(session)
    _, key = factories.api_key(session, t)
    lines = [
        {"custom_id": "a", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "Hello", "max_tokens": 3}},
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": ["x", "y"], "max_tokens": 2, "user": "u1", "priority": 1},
        },
    ]
    bid = factories.validating_batch(session, t, key, lines, lease_s=300)

    assert ingest.validate(sessions, bid, it_settings) == BatchStatus.in_progress

    with sessions() as s:
        b = s.get(Batch, bid)
        assert b is not None and b.lease_until is None and b.in_progress_at is not None
        assert b.request_counts == {"total": 2, "completed": 0, "failed": 0}
        jobs = s.execute(select(Job).where(Job.batch_id == bid).order_by(Job.line_no)).scalars().all()
        stored = [{c: getattr(j, c) for c in ingest.COLUMNS} for j in jobs]
    assert [(r["line_no"], r["custom_id"]) for r in stored] == [(1, "a"), (2, "b")]
    for r, line in zip(stored, lines, strict=True):
        # every column new_row fills, as it fills it for this line (the id and the translation aside)
        expected = transitions.new_row(
            tenant_id=t.id,
            key_id=key.id,
            model=MODEL,
            kind=JobKind.batch,
            priority=line["body"].get("priority", 0),
            params=r["params"],
            prompts=r["prompts"],
            stream=False,
            user=line["body"].get("user"),
            batch_id=bid,
            line_no=r["line_no"],
            custom_id=line["custom_id"],
            reserved_tokens=r["reserved_tokens"],
            job_id=r["id"],
        )
        assert r == expected
        assert r["params"]["max_tokens"] == line["body"]["max_tokens"] and r["reserved_tokens"] > 0
    assert len(stored[1]["prompts"]) == 2


def test_a_bad_line_fails_the_batch_and_stores_no_job(sessions, session, it_settings):
    t = factories.tenant(session)
    _, key = factories.api_key(session, t)
    good = {"custom_id": "a", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 1}}
    bid = factories.validating_batch(
        session, t, key, [good, {**good, "custom_id": "b", "url": "/v1/embeddings"}], lease_s=300
    )

    assert ingest.validate(sessions, bid, it_settings) == BatchStatus.failed

    with sessions() as s:
        b = s.get(Batch, bid)
        assert b is not None and b.status == BatchStatus.failed and b.failed_at is not None and b.lease_until is None
        assert b.request_counts == {"total": 2, "completed": 0, "failed": 0}
        assert [(e["code"], e["line"]) for e in (b.errors or {})["data"]] == [("mismatched_url", 2)]
        assert s.execute(select(Job.id).where(Job.batch_id == bid)).first() is None
