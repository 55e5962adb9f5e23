"""The job state machine: queued -> dispatched -> running -> succeeded | failed | cancelled | expired.

Every transition is exactly one conditional UPDATE (compare-and-set on state and, where a worker is
involved, attempt). A duplicate Celery delivery, a late worker or a double cancel therefore matches
no row and changes nothing. Each function below builds one statement; callers execute it on a
sync session (workers, dispatcher) or an async one (API) and commit.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple, ParamSpec, cast

from sqlalchemy import (
    ARRAY,
    Boolean,
    Exists,
    Insert,
    Integer,
    Interval,
    Select,
    String,
    Table,
    Update,
    and_,
    any_,
    bindparam,
    case,
    exists,
    func,
    insert,
    literal,
    not_,
    null,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.orm import defer, undefer

from core.infra.orm import Job
from core.jobs import tiers
from core.jobs.tiers import Tier
from core.states import TERMINAL_STATES, JobKind, JobState

ACTIVE_STATES = (JobState.queued, JobState.dispatched, JobState.running)
_JOBS = cast(Table, Job.__table__)  # statements built once use the table, not the ORM class
P = ParamSpec("P")


def new_job_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def new_row(
    *,
    tenant_id: int,
    model: str,
    params: dict[str, Any],
    prompts: list[dict[str, Any]],  # each a core.generation.prompt.Prompt's to_json()
    stream: bool,
    user: str | None = None,
    priority: int = 0,
    key_id: int | None = None,
    kind: JobKind = JobKind.interactive,
    reserved_tokens: int = 0,
    job_id: str | None = None,
    chat: dict[str, Any] | None = None,
    request_id: str | None = None,
    batch_id: str | None = None,
    line_no: int | None = None,
    custom_id: str | None = None,
    service_tier: str = "default",
    affinity: int | None = None,
) -> dict[str, Any]:
    """A new job's columns, queued at attempt 1: the one builder of job rows. `new_job` makes an ORM
    object of them (the API's request); the batch validator COPYs them as they are, a plain dict per
    line with no ORM object (core/batches/ingest.py)."""
    return {
        "id": job_id or new_job_id(),
        "tenant_id": tenant_id,
        "key_id": key_id,
        "model": model,
        "kind": JobKind(kind).value,  # the column holds the plain value
        "state": JobState.queued.value,
        "attempt": 1,
        "priority": priority,
        "params": params,
        "prompts": prompts,
        "chat": chat,
        "stream": stream,
        "user": user,
        "request_id": request_id,
        "batch_id": batch_id,
        "line_no": line_no,
        "custom_id": custom_id,
        "reserved_tokens": reserved_tokens,
        "service_tier": service_tier,
        "affinity": affinity,
    }


def _as_job(row: Callable[P, dict[str, Any]]) -> Callable[P, Job]:
    def job(*args: P.args, **kw: P.kwargs) -> Job:
        return Job(**row(*args, **kw))

    return job


# `new_row` as an ORM `Job`, with `new_row`'s keywords (checked by mypy at every caller).
new_job = _as_job(new_row)


# What a new interactive job's INSERT writes of `new_row`'s columns (its state is decided by the
# statement; a batch line's columns are NULL).
_NEW = (
    "id",
    "tenant_id",
    "key_id",
    "model",
    "kind",
    "reserved_tokens",
    "priority",
    "service_tier",
    "affinity",
    "params",
    "prompts",
    "stream",
    "chat",
    "request_id",
    "user",
    "attempt",
)


_IN_FLIGHT_STATES = literal([JobState.dispatched.value, JobState.running.value], ARRAY(String))


def in_flight(tenant_id: Any):
    """How many of a tenant's jobs are dispatched or running (its concurrency); `tenant_id` may be a
    bound parameter."""
    return (
        select(func.count())
        .select_from(Job)
        # `= ANY(array)`, one bound value, rather than an expanding `IN`: the API's group INSERT runs it
        # per row of an executemany, which cannot expand a list (Postgres plans both alike).
        .where(Job.tenant_id == tenant_id, Job.state == any_(_IN_FLIGHT_STATES))
        .scalar_subquery()
    )


def interactive_in_flight(model: Any) -> Any:
    """A model's API requests dispatched or running (flex ones aside: they hold batch slots), as a scalar
    subquery; `model` may be a bound parameter. A range of `ix_jobs_queue`, as long as the workers' slots."""
    return (
        select(func.count())
        .select_from(Job)
        .where(
            Job.model == model,
            Job.state == any_(_IN_FLIGHT_STATES),
            Job.kind == JobKind.interactive.value,
            Job.service_tier != Tier.flex.value,
        )
        .scalar_subquery()
    )


def _contended(model: Any, ahead: Any, capacity: Any, rank: Any) -> Any:
    """Whether a new request must wait for the fair dispatcher rather than go straight to a worker: a
    request of a tier at or ahead of its own (`ahead`) is queued for the model already (it would be
    overtaken), or the model's requests in flight fill `capacity` (its live workers' slots: more would
    wait inside a worker, in arrival order, where no tenant's share is kept). `rank`:
    the model's requests ahead of this one in the same statement. Both are index range scans of a few
    entries (`ix_jobs_queued_tier`; `ix_jobs_queue`)."""
    waiting = (
        select(literal(1))
        .select_from(Job)
        .where(
            Job.model == model,
            Job.state == JobState.queued.value,
            Job.kind == JobKind.interactive.value,
            Job.service_tier == any_(ahead),
        )
        .exists()
    )
    return or_(waiting, interactive_in_flight(model) + rank >= capacity)


def _insert() -> Insert:
    c = _JOBS.c
    cap = bindparam("b_cap", type_=Integer)
    in_flight_now = in_flight(bindparam("b_tenant_id", type_=c.tenant_id.type))
    rank = bindparam("b_rank", type_=Integer)  # the tenant's jobs ahead of this one in the same statement
    contended = _contended(
        bindparam("b_model", type_=c.model.type),
        bindparam("b_ahead", type_=ARRAY(String)),
        bindparam("b_capacity", type_=Integer),
        bindparam("b_model_rank", type_=Integer),
    )
    room = and_(bindparam("b_dispatch", type_=Boolean), or_(cap.is_(None), in_flight_now + rank < cap), not_(contended))
    values: dict[str, Any] = {n: bindparam(f"b_{n}", type_=c[n].type) for n in _NEW}
    values["state"] = case((room, JobState.dispatched.value), else_=JobState.queued.value)
    values["dispatched_at"] = case((room, func.now()), else_=null())
    return insert(_JOBS).values(values).returning(c.id, c.state, c.created_at, c.dispatched_at)


INSERT = _insert()


def insert_new(job: Job, cap: int | None, dispatch: bool, capacity: int) -> tuple[Insert, dict[str, Any]]:
    """Store a new job in one statement, already `dispatched` when `dispatch`, its tenant is under its
    concurrency cap and its model is not contended (`_contended`: else `queued`, for the fair
    dispatcher, which then chooses by tokens between tenants); returns (id, state, created_at,
    dispatched_at). Built once, on the table: the ORM's flush plus a second UPDATE was two round trips
    and a unit of work per request. Replicas racing may overshoot the cap or `capacity` by a job or two;
    the dispatcher, which feeds everything else, counts exactly."""
    return INSERT, _new_params(job, cap, dispatch, 0, capacity, 0)


def insert_group(jobs: Sequence[tuple[Job, int | None]], capacity: Callable[[str], int]) -> list[dict[str, Any]]:
    """`INSERT`'s parameters for several new interactive jobs stored by one statement (the API's group
    commit): rows come back in this order. One statement sees one snapshot, so the jobs in the group do
    not see each other: each counts those of its tenant ahead of it (`b_rank`) against the cap, and
    those of its model (`b_model_rank`) against its model's `capacity`."""
    ahead: dict[int, int] = {}
    per_model: dict[str, int] = {}
    out = []
    for job, cap in jobs:
        rank = ahead.get(job.tenant_id, 0)
        ahead[job.tenant_id] = rank + 1
        model_rank = per_model.get(job.model, 0)
        per_model[job.model] = model_rank + 1
        out.append(_new_params(job, cap, True, rank, capacity(job.model), model_rank))
    return out


def _new_params(job: Job, cap: int | None, dispatch: bool, rank: int, capacity: int, model_rank: int) -> dict[str, Any]:
    tier = Tier(job.service_tier or Tier.default)
    return {
        "b_cap": cap,
        "b_dispatch": dispatch and tier != Tier.flex,  # flex waits in its lane for batch slots
        "b_rank": rank,
        "b_ahead": tiers.ahead_of(tier),
        "b_capacity": capacity,
        "b_model_rank": model_rank,
        **{f"b_{n}": getattr(job, n) for n in _NEW},
    }


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


def claim(job_id: str, attempt: int, worker: str, lease_s: float) -> tuple[Update, dict[str, Any]]:
    """dispatched -> running, by the worker that got attempt `attempt`'s message. One winner."""
    return CLAIM_ONE, {"b_id": job_id, "b_attempt": attempt, "b_worker": worker, "b_lease": timedelta(seconds=lease_s)}


class Claimed(NamedTuple):
    """What an attempt needs of the job it claimed: a plain row, not an ORM `Job` (loading the whole
    row into the ORM, result and usage columns, identity map and all, was a quarter of a worker's CPU
    per short job)."""

    id: str
    attempt: int
    tenant_id: int
    key_id: int | None
    model: str
    kind: str
    params: dict[str, Any]
    prompts: list[Any]
    request_id: str | None
    created_at: datetime | None
    started_at: datetime | None
    service_tier: str = "default"  # a flex request decodes as batch work does (workers/attempt.py)
    stream: bool = True  # a flex request nobody streams publishes as a batch line does


# Built once with bound parameters, on the table: building this ORM UPDATE per claim, and letting the
# ORM look for session objects to synchronise, cost ~1 ms of a worker's CPU per job.
_CLAIM = (
    update(_JOBS)
    .values(
        state=JobState.running.value,
        worker=bindparam("b_worker"),
        started_at=func.now(),
        lease_until=func.now() + bindparam("b_lease", type_=Interval),
    )
    .returning(*(_JOBS.c[n] for n in Claimed._fields))
)
CLAIM = _CLAIM.where(
    _JOBS.c.state == JobState.dispatched.value,
    tuple_(_JOBS.c.id, _JOBS.c.attempt).in_(bindparam("b_pairs", expanding=True)),
)


# One job (every interactive request): plain parameters, not the group's expanding `(id, attempt) IN`,
# which SQLAlchemy re-renders into new SQL text on every execution (~9 % of a worker's CPU on short
# jobs); a constant text also lets psycopg prepare it once on each connection.
CLAIM_ONE = _CLAIM.where(
    _JOBS.c.state == JobState.dispatched.value,
    _JOBS.c.id == bindparam("b_id"),
    _JOBS.c.attempt == bindparam("b_attempt"),
)


def claimed(rows: Iterable[Any]) -> list[Claimed]:
    """The rows `CLAIM` returned, typed."""
    return [Claimed._make(r) for r in rows]


def claim_many(pairs: list[tuple[str, int]], worker: str, lease_s: float) -> tuple[Update, dict[str, Any]]:
    """`claim` for one job or several (a group message of batch lines) in one statement: each row
    still needs its own state and attempt to match, so a stale pair in the group claims nothing.
    Returns the `Claimed` columns (`claimed` types them)."""
    return CLAIM, {"b_pairs": list(pairs), "b_worker": worker, "b_lease": timedelta(seconds=lease_s)}


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
ENDED = tuple(
    _JOBS.c[n] for n in ("id", "tenant_id", "key_id", "model", "kind", "service_tier", "created_at", "finished_at")
)


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


# Each ending keeps the marks of the job's stream on its row (`Job.marks`, read by the ending just
# before it: core/jobs/lifecycle.py), in the same statement.
SUCCEED = _ending(JobState.succeeded, "result", "usage", "marks")
FAIL = _ending(JobState.failed, "error", "marks")


def succeed(
    job_id: str, attempt: int, result: dict[str, Any], usage: dict[str, Any], marks: str | None = None
) -> tuple[Update, dict[str, Any]]:
    return SUCCEED, {"b_job_id": job_id, "b_attempt": attempt, "b_result": result, "b_usage": usage, "b_marks": marks}


def fail(job_id: str, attempt: int, error: dict[str, Any], marks: str | None = None) -> tuple[Update, dict[str, Any]]:
    return FAIL, {"b_job_id": job_id, "b_attempt": attempt, "b_error": error, "b_marks": marks}


def cancel_queued_of_tenant(tenant_id: int) -> Update:
    """Every queued job of a tenant -> cancelled, at once, with no usage row, settlement or event: only
    for a tool clearing a backlog it wrote into the ledger itself (ops/fairness.py), never for jobs
    a client waits on (those go through the lifecycle)."""
    return (
        update(Job)
        .where(Job.tenant_id == tenant_id, Job.state == JobState.queued.value)
        .values(state=JobState.cancelled.value, finished_at=func.now())
    )


def fail_queued(job_id: str, attempt: int, error: dict[str, Any], marks: str | None = None) -> Update:
    """queued -> failed, before it ever ran (a batch line refused by its tenant's daily quota as it
    dispatches; `marks`: what an earlier attempt streamed, if one did). Returns `ENDED`."""
    c = _JOBS.c
    return (
        update(_JOBS)
        .where(c.id == job_id, c.state == JobState.queued.value, c.attempt == attempt)
        .values(state=JobState.failed.value, finished_at=func.now(), lease_until=None, error=error, marks=marks)
        .returning(*ENDED)
    )


def end_queued_lines(batch_id: str, to: JobState, error: dict[str, Any], limit: int) -> Update:
    """Up to `limit` of a batch's queued lines -> `to` (expired: its window ended; cancelled: the
    batch was cancelled), in one statement; lines another transaction holds (the dispatcher picking
    them) are skipped, and the compare-and-set on `queued` leaves any line that moved on alone.
    Returns `ENDED` and each line's attempt."""
    c = _JOBS.c
    # A CTE, evaluated once: as an `IN (subquery)` the planner may rescan the locking subquery per
    # row and end more than `limit` lines in one statement.
    picked = (
        select(c.id)
        .where(c.batch_id == batch_id, c.state == JobState.queued.value)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("picked")
    )
    return (
        update(_JOBS)
        .where(c.id == picked.c.id, c.state == JobState.queued.value)
        .values(state=to.value, finished_at=func.now(), lease_until=None, error=error)
        .returning(*ENDED, c.attempt)
    )


def cancel(job_id: str, tenant_id: int, error: dict[str, Any]) -> Update:
    """Any live state -> cancelled. Only the owner can; a second cancel matches nothing."""
    stmt = _transition(
        job_id, ACTIVE_STATES, JobState.cancelled, finished_at=func.now(), lease_until=None, error=error
    ).returning(Job)
    return stmt.where(Job.tenant_id == tenant_id)


def keep_cancelled(row: Job, usage: dict[str, Any], result: dict[str, Any] | None) -> None:
    """What a job just cancelled (`cancel`'s returned row, in its session) had generated: its usage
    and its partial result, written with the cancel's transaction. Not a state change."""
    row.usage = usage
    if result is not None:
        row.result = result


def keep_marks(row: Job, marks: str | None) -> None:
    """The marks of a job's stream (core/infra/streams/write.py `marks_of`) kept on the row an ending
    returned (`cancel`, `fail_lapsed`), in its session: written with the ending's transaction. Not a
    state change."""
    if marks is not None:
        row.marks = marks


UNENDED = (JobState.queued.value, JobState.dispatched.value, JobState.running.value)


def any_unended() -> Exists:
    """Some job is queued, dispatched or running: the dispatcher's idle pass asks only this (one probe
    of ix_jobs_state_created) before the reaping, re-sending and picking that find nothing otherwise."""
    return exists().where(Job.state.in_(UNENDED))


def batch_in_flight(model: str):
    """Batch lines and flex requests of a model dispatched or running: the batch slots they hold."""
    return (
        select(func.count())
        .select_from(Job)
        .where(
            Job.model == model,
            or_(Job.kind == JobKind.batch.value, Job.service_tier == Tier.flex.value),
            Job.state.in_([JobState.dispatched.value, JobState.running.value]),
        )
    )


def held_past(model: str, wait_s: float, limit: int) -> Select:
    """(id, attempt) of a model's API requests queued longer than `wait_s` (`ix_jobs_queued_tier`)."""
    return (
        select(Job.id, Job.attempt)
        .where(
            Job.model == model,
            Job.state == JobState.queued.value,
            Job.kind == JobKind.interactive.value,
            Job.created_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, wait_s),
        )
        .limit(limit)
    )


def update_chat(where: Sequence[Any], chat: Any) -> Update:
    """A job's `chat` rewritten, never its state: a stored chat completion's metadata or its forgetting
    (core/jobs/chat_store.py)."""
    return update(_JOBS).where(*where).values(chat=chat)


def requests_queued(model: str) -> Select:
    """Whether any API request of the model waits for the fair dispatcher (`ix_jobs_queued_tier`)."""
    queued = exists().where(
        Job.model == model, Job.state == JobState.queued.value, Job.kind == JobKind.interactive.value
    )
    return select(queued)


def dispatch_picked(job_ids: list[str]) -> Update:
    """The fair scheduler's picks -> dispatched (compare-and-set: one dispatcher wins each row)."""
    return (
        update(Job)
        .where(Job.id.in_(job_ids), Job.state == JobState.queued.value)
        .values(state=JobState.dispatched.value, dispatched_at=func.now())
        .returning(Job.id, Job.attempt, Job.model, Job.kind, Job.affinity)
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
        .returning(Job.id, Job.attempt, Job.model, Job.kind, Job.affinity)
    )


def running_holders(models: Sequence[str]) -> Select:
    """The workers (`hostname:pid`) holding running jobs of these models."""
    return (
        select(Job.worker)
        .where(Job.state == JobState.running.value, Job.model.in_(models), Job.worker.is_not(None))
        .distinct()
    )


def requeue_held_by(holders: Sequence[str], max_attempts: int) -> Update:
    """The running jobs of these workers -> queued with the next attempt, in this one statement (a
    worker Redis no longer hears, whose jobs' streams would stay silent; core/dispatcher.py). Ending
    their leases for the reaper's next statement left a window in which the cut worker, which still
    reaches Postgres, renewed them back. A job on its last attempt is left to `fail_lapsed` (its
    lease ended here)."""
    return (
        update(Job)
        .where(Job.state == JobState.running.value, Job.worker.in_(holders))
        .values(
            state=case((Job.attempt < max_attempts, JobState.queued.value), else_=Job.state),
            attempt=case((Job.attempt < max_attempts, Job.attempt + 1), else_=Job.attempt),
            lease_until=case((Job.attempt < max_attempts, null()), else_=func.now() - timedelta(seconds=1)),
            dispatched_at=case((Job.attempt < max_attempts, null()), else_=Job.dispatched_at),
        )
        .returning(Job.id, Job.model)
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


# What a job's ending wrote, for the API to answer a request that waited for it (it has the rest).
ENDING_COLUMNS = ("state", "attempt", "result", "usage", "error", "started_at", "finished_at")
ENDING = select(*(_JOBS.c[n] for n in ENDING_COLUMNS)).where(
    _JOBS.c.id == bindparam("b_id"), _JOBS.c.tenant_id == bindparam("b_tenant")
)


def get_for_tenant(job_id: str, tenant_id: int, *, without_result: bool = False):
    """The job, if it belongs to `tenant_id` (another tenant's job is simply not found).
    `without_result`: all but the result, which raises if read (a stream of the job's events holds
    its row for as long as it runs and needs none of the result)."""
    query = select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id)
    # With its result, the row may answer a resume once the stream has expired: its marks too.
    return query.options(defer(Job.result, raiseload=True)) if without_result else query.options(undefer(Job.marks))


def is_terminal(state: str) -> bool:
    return JobState(state) in TERMINAL_STATES


# A deleted response (`DELETE /v1/responses/{id}`, core/jobs/responses.py): the job stays (its usage,
# its place in the ledger), its state untouched; the response's input is dropped and it reads as gone.
FORGET_RESPONSE = text(
    "UPDATE jobs SET chat = jsonb_set(chat, '{response}', (chat->'response') || "
    '\'{"deleted": true, "input": []}\'::jsonb) '
    "WHERE id = :id AND tenant_id = :tenant AND chat->'response' IS NOT NULL "
    "AND coalesce(chat->'response'->>'deleted', 'false') <> 'true' RETURNING id"
)
