"""A worker claims and ends jobs with single statements on autocommit connections
(core/infra/autocommit.py): the claim returns a plain typed row, and an ending and its usage row are one
statement (a data-modifying CTE). Both must keep the ledger's rules: compare-and-set, usage counted
exactly once per job, added to the day's row of the tenant, key and model."""

from __future__ import annotations

from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import sessionmaker

from core.generation.events import ChoiceResult, ErrorInfo, JobResult, Usage
from core.infra.autocommit import one_statement
from core.infra.orm import Job, UsageDaily
from core.jobs import transitions
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from ops import factories


def _usage_rows(session, tenant_id: int) -> list[UsageDaily]:
    session.expire_all()
    return list(session.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant_id)))


def test_a_claim_returns_what_an_attempt_needs_once(session, sessions):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, attempt=2, request_id="req-1")
    stmt = transitions.claim(job.id, 2, "w-1", 60)
    (got,) = transitions.claimed(one_statement(sessions, *stmt))
    assert isinstance(got, transitions.Claimed)
    assert (got.id, got.attempt, got.tenant_id, got.model, got.kind, got.request_id) == (
        job.id,
        2,
        t.id,
        job.model,
        "interactive",
        "req-1",
    )
    assert got.params == job.params and got.prompts == job.prompts
    assert got.started_at is not None and got.created_at is not None
    assert transitions.claimed(one_statement(sessions, *stmt)) == []  # a duplicate message claims nothing
    row = session.get(Job, job.id, populate_existing=True)
    assert (row.state, row.worker) == ("running", "w-1")


def test_endings_add_to_one_usage_row_each_job_once(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    a, b, c = (factories.job(session, t, state=JobState.running) for _ in range(3))
    life = Lifecycle(sessions, rds, it_settings)
    result = JobResult(choices=[ChoiceResult(index=0, text="x", finish_reason="length")])
    assert life.succeed(a, result, Usage(prompt_tokens=3, completion_tokens=2), 0.5)
    assert life.succeed(b, result, Usage(prompt_tokens=4, completion_tokens=1), 0.25)
    assert life.fail(c, ErrorInfo(message="boom"), Usage(prompt_tokens=1, completion_tokens=1))
    # Late or duplicate endings: no row, nothing billed.
    assert not life.succeed(a, result, Usage(prompt_tokens=100), 9.0)
    assert not life.fail(b, ErrorInfo(message="late"), Usage(prompt_tokens=100))
    (u,) = _usage_rows(session, t.id)
    assert (u.key_id, u.requests, u.failed, u.prompt_tokens, u.completion_tokens) == (0, 3, 1, 8, 4)
    assert abs(u.gpu_seconds - 0.75) < 1e-9
    states = {j.id: session.get(Job, j.id, populate_existing=True).state for j in (a, b, c)}
    assert states == {a.id: "succeeded", b.id: "succeeded", c.id: "failed"}


def test_a_pooled_connection_is_transactional_again_after_one_statement(sessions):
    """The autocommit engine shares the pool: a session that gets the same connection next must
    still be able to roll back (SQLAlchemy resets the isolation level when the connection returns)."""
    engine = create_engine(sessions.kw["bind"].url, pool_size=1, max_overflow=0)  # one connection: the same
    one = sessionmaker(engine)
    try:
        one_statement(one, text("CREATE TEMP TABLE t_one(x int)"))  # lives as long as the connection
        with one() as s:
            assert s.connection().connection.dbapi_connection.autocommit is False
            s.execute(text("INSERT INTO t_one VALUES (1)"))
            s.rollback()
        assert one_statement(one, text("SELECT count(*) FROM t_one")) == [(0,)]
        assert one_statement(one, text("SET application_name = 'x'")) == []  # no rows: an empty list
    finally:
        engine.dispose()
