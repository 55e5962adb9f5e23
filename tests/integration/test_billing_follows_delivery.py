"""Billing follows delivery: a job whose stream carried tokens and then failed (the engine's verdict)
or was reaped for good (its last worker lost) bills what its stream carried, in its usage row and in
the settlement of its rate-limit reservation, as a cancel does. Real Postgres and Redis, in-process."""

from __future__ import annotations

from sqlalchemy import select

from core.generation.events import Delta, ErrorInfo, Failed, decode
from core.infra.orm import UsageDaily
from core.infra.streams import write
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from core.tenancy import limits
from ops import factories

PROMPT = [{"ids": [5, 6, 7, 8], "text": None}]


def _streamed(rds, job, lifecycle: Lifecycle) -> None:
    """The job's attempt streamed five tokens, the last delta ending with an end-of-sequence token."""
    write.raise_fence(rds, job.id, job.attempt, 60)
    lifecycle.publish_deltas(
        job.id, job.attempt, [Delta(attempt=job.attempt, choice=0, text="a b", token_ids=[1, 2])], start=1
    )
    lifecycle.publish_deltas(
        job.id, job.attempt, [Delta(attempt=job.attempt, choice=0, text=" c d", token_ids=[3, 4], eos=True)], start=2
    )


def _reserved(rds, job, tenant_id: int) -> str:
    """Admission's reservation for the job (prompt + max_tokens against the daily quota); returns the
    daily counter's key."""
    (d,) = limits.admit_many(rds, [(tenant_id, 0, job.id, limits.Limits(tpd=10_000), 100)])
    assert d.allowed
    return rds.hget(limits.reservation_key(job.id), "tpd").decode()


def _usage(session, tenant_id: int) -> tuple[int, int, int, int]:
    session.expire_all()
    rows = session.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant_id)).all()
    assert len(rows) == 1
    u = rows[0]
    return u.requests, u.failed, u.prompt_tokens, u.completion_tokens


def test_a_job_that_streamed_then_failed_bills_what_it_streamed(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running, prompts=PROMPT)
    lifecycle = Lifecycle(sessions, rds, it_settings)
    tpd = _reserved(rds, job, t.id)
    _streamed(rds, job, lifecycle)

    err = ErrorInfo(message="Generation failed: boom", type="server_error", code="engine_error")
    assert lifecycle.fail(job, err)

    # 4 prompt tokens, 4 generated tokens + the end-of-sequence token it streamed.
    assert _usage(session, t.id) == (1, 1, 4, 5)
    assert int(rds.get(tpd)) == 9  # the reservation settled to what was delivered, not to 0
    assert not lifecycle.fail(job, err)  # exactly once
    assert _usage(session, t.id) == (1, 1, 4, 5)


def test_a_job_that_streamed_then_lost_its_last_worker_bills_what_it_streamed(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    last = it_settings.max_attempts
    job = factories.job(session, t, state=JobState.running, attempt=last, lease_s=-5, prompts=PROMPT)
    lifecycle = Lifecycle(sessions, rds, it_settings)
    tpd = _reserved(rds, job, t.id)
    _streamed(rds, job, lifecycle)

    assert lifecycle.reap()["failed"] >= 1

    assert _usage(session, t.id) == (1, 1, 4, 5)
    assert int(rds.get(tpd)) == 9
    end = decode(write.entries(rds, job.id)[-1][1])
    assert isinstance(end, Failed) and end.error.code == "worker_lost"


def test_a_job_that_failed_before_streaming_anything_bills_nothing(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running, prompts=PROMPT)
    lifecycle = Lifecycle(sessions, rds, it_settings)
    tpd = _reserved(rds, job, t.id)
    assert lifecycle.fail(job, ErrorInfo(message="Invalid grammar", type="invalid_request_error"))
    assert _usage(session, t.id) == (1, 1, 0, 0)
    assert int(rds.get(tpd)) == 0
