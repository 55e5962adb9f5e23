"""The job state machine: queued -> dispatched -> running -> succeeded | failed | cancelled | expired.

Every transition is exactly one conditional UPDATE (compare-and-set on state and, where a worker is
involved, attempt). A duplicate Celery delivery, a late worker or a double cancel therefore matches
no row and changes nothing. Each function below builds one statement; callers execute it on a
sync session (workers, dispatcher) or an async one (API) and commit.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import Table, Update, bindparam, func, select, tuple_, update

from core.infra.orm import TERMINAL_STATES, Job, JobState

ACTIVE_STATES = (JobState.queued, JobState.dispatched, JobState.running)


def new_job_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def new_job(
    *,
    tenant_id: int,
    model: str,
    params: dict[str, Any],
    prompts: list[Any],
    stream: bool,
    user: str | None = None,
    priority: int = 0,
    key_id: int | None = None,
    kind: str = "interactive",
    reserved_tokens: int = 0,
    job_id: str | None = None,
    chat: dict[str, Any] | None = None,
    request_id: str | None = None,
) -> Job:
    return Job(
        chat=chat,
        request_id=request_id,
        id=job_id or new_job_id(),
        tenant_id=tenant_id,
        key_id=key_id,
        model=model,
        kind=kind,
        params=params,
        prompts=prompts,
        stream=stream,
        user=user,
        priority=priority,
        reserved_tokens=reserved_tokens,
        state=JobState.queued.value,
        attempt=1,
    )


def _transition(
    job_id: str, from_states: Iterable[JobState], to: JobState, attempt: int | None = None, **values: Any
) -> Update:
    cond = [Job.id == job_id, Job.state.in_([s.value for s in from_states])]
    if attempt is not None:
        cond.append(Job.attempt == attempt)
    return update(Job).where(*cond).values(state=to.value, **values)


def mark_dispatched(job_id: str, attempt: int) -> Update:
    """queued -> dispatched, just before its message is sent."""
    return _transition(job_id, [JobState.queued], JobState.dispatched, attempt, dispatched_at=func.now()).returning(Job)


def undispatch(job_id: str, attempt: int) -> Update:
    """dispatched -> queued, when sending its message failed; the dispatcher will try again."""
    return _transition(job_id, [JobState.dispatched], JobState.queued, attempt, dispatched_at=None).returning(Job)


def claim(job_id: str, attempt: int, worker: str, lease_s: float) -> Update:
    """dispatched -> running, by the worker that got attempt `attempt`'s message. One winner."""
    return claim_many([(job_id, attempt)], worker, lease_s)


def claim_many(pairs: list[tuple[str, int]], worker: str, lease_s: float) -> Update:
    """`claim` for one job or several (a group message of batch lines) in one statement: each row
    still needs its own state and attempt to match, so a stale pair in the group claims nothing."""
    return (
        update(Job)
        .where(Job.state == JobState.dispatched.value, tuple_(Job.id, Job.attempt).in_(pairs))
        .values(
            state=JobState.running.value,
            worker=worker,
            started_at=func.now(),
            lease_until=func.now() + timedelta(seconds=lease_s),
        )
        .returning(Job)
    )


def renew_lease(job_id: str, attempt: int, lease_s: float) -> Update:
    """Extend a running job's lease. No row back: it was cancelled, or another attempt owns it."""
    return (
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.running.value, Job.attempt == attempt)
        .values(lease_until=func.now() + timedelta(seconds=lease_s))
        .returning(Job.id)
    )


# What ending a job needs back (usage row, metrics, announcement): not the prompts, params and result,
# which the ORM would otherwise parse back out of JSONB for every finished job.
_JOBS = cast(Table, Job.__table__)
ENDED = tuple(_JOBS.c[n] for n in ("id", "tenant_id", "key_id", "model", "kind", "created_at", "finished_at"))


def _ending(to: JobState, *fields: str) -> Update:
    """running -> an end, built once with bound parameters (b_job_id, b_attempt, b_<field>), on the
    table rather than the ORM class: building an ORM-enabled UPDATE per finished job cost a worker a
    noticeable share of its CPU, and nothing here needs an ORM object back."""
    c = _JOBS.c
    return (
        update(_JOBS)
        .where(c.id == bindparam("b_job_id"), c.state == JobState.running.value, c.attempt == bindparam("b_attempt"))
        .values(
            state=to.value,
            finished_at=func.now(),
            lease_until=None,
            **{f: bindparam(f"b_{f}", type_=c[f].type) for f in fields},
        )
        .returning(*ENDED)
    )


SUCCEED = _ending(JobState.succeeded, "result", "usage")
FAIL = _ending(JobState.failed, "error")


def succeed(job_id: str, attempt: int, result: dict[str, Any], usage: dict[str, Any]) -> tuple[Update, dict[str, Any]]:
    return SUCCEED, {"b_job_id": job_id, "b_attempt": attempt, "b_result": result, "b_usage": usage}


def fail(job_id: str, attempt: int, error: dict[str, Any]) -> tuple[Update, dict[str, Any]]:
    return FAIL, {"b_job_id": job_id, "b_attempt": attempt, "b_error": error}


def cancel(job_id: str, tenant_id: int, error: dict[str, Any]) -> Update:
    """Any live state -> cancelled. Only the owner can; a second cancel matches nothing."""
    stmt = _transition(
        job_id, ACTIVE_STATES, JobState.cancelled, finished_at=func.now(), lease_until=None, error=error
    ).returning(Job)
    return stmt.where(Job.tenant_id == tenant_id)


def in_flight(tenant_id: int):
    """How many of a tenant's jobs are dispatched or running (its concurrency)."""
    return (
        select(func.count())
        .select_from(Job)
        .where(Job.tenant_id == tenant_id, Job.state.in_([JobState.dispatched.value, JobState.running.value]))
        .scalar_subquery()
    )


def batch_in_flight(model: str):
    """Batch lines of a model dispatched or running: the batch slots they hold."""
    return (
        select(func.count())
        .select_from(Job)
        .where(
            Job.model == model,
            Job.kind == "batch",
            Job.state.in_([JobState.dispatched.value, JobState.running.value]),
        )
    )


def dispatch_now(job_id: str, attempt: int, tenant_id: int, cap: int | None) -> Update:
    """queued -> dispatched right after admission, if the tenant is under its concurrency cap (else
    the job waits in Postgres for the fair dispatcher). Replicas racing may overshoot the cap by a
    job or two; the dispatcher, which feeds everything else, counts exactly."""
    stmt = mark_dispatched(job_id, attempt)
    if cap is not None:
        stmt = stmt.where(in_flight(tenant_id) < cap)
    return stmt


def dispatch_picked(job_ids: list[str]) -> Update:
    """The fair scheduler's picks -> dispatched (compare-and-set: one dispatcher wins each row)."""
    return (
        update(Job)
        .where(Job.id.in_(job_ids), Job.state == JobState.queued.value)
        .values(state=JobState.dispatched.value, dispatched_at=func.now())
        .returning(Job.id, Job.attempt, Job.model, Job.kind)
    )


def touch_stale_dispatched(timeout_s: float, limit: int, models: list[str]) -> Update:
    """Jobs of `models` `dispatched` but never claimed: their message was lost. Restamp them for a
    re-send; the claim's compare-and-set makes a re-send of a message that was merely slow harmless."""
    stale = (
        select(Job.id)
        .where(
            Job.state == JobState.dispatched.value,
            Job.model.in_(models),
            Job.dispatched_at < func.now() - timedelta(seconds=timeout_s),
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return (
        update(Job)
        .where(Job.id.in_(stale), Job.state == JobState.dispatched.value)
        .values(dispatched_at=func.now())
        .returning(Job.id, Job.attempt, Job.model, Job.kind)
    )


def requeue_lapsed(max_attempts: int) -> Update:
    """running jobs whose worker stopped renewing -> queued with the next attempt number."""
    return (
        update(Job)
        .where(
            Job.state == JobState.running.value,
            Job.lease_until < func.now(),
            Job.attempt < max_attempts,
        )
        .values(state=JobState.queued.value, attempt=Job.attempt + 1, lease_until=None, dispatched_at=None)
        .returning(Job.id, Job.attempt, Job.model)
    )


def fail_lapsed(max_attempts: int, error: dict[str, Any]) -> Update:
    """running jobs whose last allowed attempt lost its worker -> failed, with a clear error."""
    return (
        update(Job)
        .where(
            Job.state == JobState.running.value,
            Job.lease_until < func.now(),
            Job.attempt >= max_attempts,
        )
        .values(
            state=JobState.failed.value,
            finished_at=func.now(),
            lease_until=None,
            error=error,
        )
        .returning(Job)
    )


def get_for_tenant(job_id: str, tenant_id: int):
    """The job, if it belongs to `tenant_id` (another tenant's job is simply not found)."""
    return select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id)


def is_terminal(state: str) -> bool:
    return JobState(state) in TERMINAL_STATES
