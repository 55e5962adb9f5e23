"""A job ends once: the lifecycle against real Postgres and Redis, in-process (no worker, no API)."""

from __future__ import annotations

from sqlalchemy import select

from core.generation.events import Cancelled, ChoiceResult, Delta, Done, ErrorInfo, Failed, JobResult, Usage, decode
from core.infra.orm import Job, UsageDaily
from core.infra.streams import keys, write
from core.jobs import transitions
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from core.tenancy import limits
from ops import factories


def _events(rds, job_id: str) -> list:
    return [decode(raw) for _, raw in write.entries(rds, job_id)]


def _streamed(life: Lifecycle, job: Job) -> None:
    """The job's first delta, as its worker publishes it: a job that wrote no stream gets no terminal
    event on one (issue 49; its readers hear its row)."""
    life.publish_deltas(job.id, job.attempt, [Delta(choice=0, text="h", token_ids=[1])], 1)


def _usage(session, tenant_id: int) -> UsageDaily | None:
    session.expire_all()
    return session.scalar(select(UsageDaily).where(UsageDaily.tenant_id == tenant_id))


def _result() -> JobResult:
    return JobResult(choices=[ChoiceResult(index=0, text="hi", finish_reason="length")])


def test_succeed_records_usage_and_publishes_done_once(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running)
    life = Lifecycle(sessions, rds, it_settings)
    _streamed(life, job)
    u = Usage(prompt_tokens=3, completion_tokens=2)
    assert life.succeed(job, _result(), u, 0.5) is True
    assert life.succeed(job, _result(), u, 0.5) is False  # a duplicate delivery changes nothing
    row = session.get(Job, job.id, populate_existing=True)
    assert row.state == "succeeded" and row.usage["completion_tokens"] == 2
    usage = _usage(session, t.id)
    assert (usage.requests, usage.failed, usage.prompt_tokens, usage.completion_tokens) == (1, 0, 3, 2)
    assert [type(e) for e in _events(rds, job.id)] == [Delta, Done]


def test_cancel_wins_over_a_late_worker_and_is_idempotent(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running)
    life = Lifecycle(sessions, rds, it_settings)
    _streamed(life, job)
    assert life.cancel(job.id, t.id).state == "cancelled"
    assert life.cancel(job.id, t.id).state == "cancelled"  # second cancel: same row, nothing more
    assert life.succeed(job, _result(), Usage(completion_tokens=5), 1.0) is False  # the late worker loses
    assert rds.exists(keys.cancel_key(job.id))  # the worker polls this and drops the job
    usage = _usage(session, t.id)
    assert (usage.requests, usage.failed, usage.completion_tokens) == (1, 1, 1)  # billed what it streamed
    assert [type(e) for e in _events(rds, job.id)] == [Delta, Cancelled]


def test_a_cancel_keeps_what_the_job_generated_on_its_row(session, sessions, rds, it_settings):
    """The cancelled row keeps its usage (what was billed) and each choice's text so far, so a
    cancelled job (a cancelled response) shows them after its stream is gone."""
    from core.generation.events import Delta

    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running)  # started: its prompt (3 tokens) is billed
    life = Lifecycle(sessions, rds, it_settings)
    deltas = [Delta(choice=0, text="Once", token_ids=[1]), Delta(choice=0, text=" upon", token_ids=[2, 3])]
    life.publish_deltas(job.id, job.attempt, deltas, 1)
    row = life.cancel(job.id, t.id)
    assert row.state == "cancelled" and row.usage["completion_tokens"] == 3 and row.usage["prompt_tokens"] == 3
    stored = session.get(Job, job.id, populate_existing=True)
    assert stored.usage == row.usage and stored.result == row.result
    assert [(c["text"], c["finish_reason"]) for c in stored.result["choices"]] == [("Once upon", None)]
    assert _usage(session, t.id).completion_tokens == 3  # billed what the row says


def test_another_tenant_cannot_cancel(session, sessions, rds, it_settings):
    owner, other = factories.tenant(session), factories.tenant(session)
    job = factories.job(session, owner)
    assert Lifecycle(sessions, rds, it_settings).cancel(job.id, other.id) is None
    assert session.get(Job, job.id, populate_existing=True).state == "queued"


def test_fail_releases_the_rate_limit_reservation(session, sessions, rds, it_settings):
    import asyncio

    import redis.asyncio as aioredis

    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running)

    async def reserve() -> None:
        r = aioredis.Redis.from_url(it_settings.redis_url)
        caps = limits.Limits(rpm=0, tpm=1000, tpd=0, max_queued=0, key_rpm=0, key_tpm=0)
        assert (await limits.admit(r, t.id, 0, job.id, caps, 500)).allowed
        await r.aclose()

    asyncio.run(reserve())
    assert rds.exists(limits.reservation_key(job.id))
    err = ErrorInfo(message="Generation failed: x", code="engine_error")
    life = Lifecycle(sessions, rds, it_settings)
    _streamed(life, job)
    assert life.fail(job, err) is True
    assert not rds.exists(limits.reservation_key(job.id))  # settled: the tokens are given back
    (_, ev) = _events(rds, job.id)
    assert isinstance(ev, Failed) and ev.error.code == "engine_error"


def test_reaper_requeues_then_fails_with_the_one_worker_lost_error(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    retry = factories.job(session, t, state=JobState.running, attempt=1, lease_s=-5)
    last = factories.job(session, t, state=JobState.running, attempt=it_settings.max_attempts, lease_s=-5)
    counts = Lifecycle(sessions, rds, it_settings).reap()
    assert counts["requeued"] >= 1 and counts["failed"] >= 1
    r = session.get(Job, retry.id, populate_existing=True)
    assert (r.state, r.attempt, r.lease_until) == ("queued", 2, None)
    f = session.get(Job, last.id, populate_existing=True)
    assert f.state == "failed" and f.error["code"] == "worker_lost"
    assert _events(rds, last.id) == []  # it streamed nothing: its row alone says how it ended (issue 49)


def test_a_group_claim_takes_only_pairs_still_dispatched_at_that_attempt(session, sessions, it_settings):
    """A group message of batch lines: each line is claimed by its own compare-and-set inside one
    statement, so a stale pair (older attempt, or no longer dispatched) claims nothing, and a
    duplicate delivery of the whole message claims nothing at all."""
    t = factories.tenant(session)
    a = factories.job(session, t, state=JobState.dispatched, kind="batch")
    b = factories.job(session, t, state=JobState.dispatched, kind="batch", attempt=2)
    queued = factories.job(session, t, state=JobState.queued, kind="batch")
    newer = factories.job(session, t, state=JobState.dispatched, kind="batch", attempt=3)
    pairs = [(a.id, 1), (b.id, 2), (queued.id, 1), (newer.id, 2)]
    for expected in ({a.id, b.id}, set()):  # the message, then its duplicate
        with sessions() as s:
            got = transitions.claimed(s.execute(*transitions.claim_many(pairs, "w-group", 60)))
            s.commit()
        assert {j.id for j in got} == expected
    for job, state in ((a, "running"), (b, "running"), (queued, "queued"), (newer, "dispatched")):
        row = session.get(Job, job.id, populate_existing=True)
        assert row.state == state
        assert (row.worker == "w-group") == (state == "running")


def test_a_new_job_is_stored_dispatched_only_while_its_tenant_is_under_its_cap(session, sessions):
    """The API's one-statement INSERT: `dispatched` (with its time) while the tenant has fewer than
    `cap` jobs dispatched or running, `queued` for the fair dispatcher otherwise, and always `queued`
    when not asked to dispatch (a batch line)."""
    t = factories.tenant(session)
    factories.job(session, t, state=JobState.running)

    def store(cap: int | None, dispatch: bool = True) -> tuple[str, bool]:
        job = transitions.new_job(tenant_id=t.id, model="m", params={}, prompts=[[1, 2]], stream=False)
        with sessions() as s:
            stmt = transitions.insert_new(job, cap, dispatch, capacity=8)
            job_id, state, created_at, dispatched_at = s.execute(*stmt).one()
            s.commit()
        assert job_id == job.id  # RETURNING names the row: the group INSERT matches rows to requests by it
        row = session.get(Job, job.id, populate_existing=True)
        assert (row.state, row.created_at, row.dispatched_at, row.prompts) == (
            state,
            created_at,
            dispatched_at,
            [[1, 2]],
        )
        return state, dispatched_at is not None

    assert store(cap=2) == ("dispatched", True)  # one running + this one: at the cap now
    assert store(cap=2) == ("queued", False)
    # A request of the model waits for the fair dispatcher now: a new one, even of a tenant without a cap,
    # is queued behind it rather than sent past it (issue 51: uncapped tenants bypassed the scheduler).
    assert store(cap=None) == ("queued", False)
    assert store(cap=None, dispatch=False) == ("queued", False)


def test_a_new_request_goes_straight_to_a_worker_only_while_its_model_is_uncontended(session, sessions):
    """`dispatched` at once only while no request of its tier or a tier ahead waits for the model and
    fewer than `capacity` of its requests are in flight; flex never (it waits for batch slots)."""
    t, other = factories.tenant(session), factories.tenant(session)

    def store(model: str, tier: str = "default", tenant=t, capacity: int = 2) -> str:
        job = transitions.new_job(
            tenant_id=tenant.id, model=model, params={}, prompts=[[1]], stream=False, service_tier=tier
        )
        with sessions() as s:
            state = s.execute(*transitions.insert_new(job, None, True, capacity=capacity)).one().state
            s.commit()
        return state

    # The model's requests in flight fill `capacity`: the workers are full, the dispatcher chooses.
    assert [store("m1"), store("m1", tenant=other), store("m1")] == ["dispatched", "dispatched", "queued"]
    assert store("m1", tenant=other, capacity=100) == "queued"  # one waits: no overtaking it, whoever asks
    assert store("m1", "priority", capacity=100) == "dispatched"  # a default request waiting is not ahead of it
    assert store("m2", "priority", capacity=0) == "queued"
    assert store("m2", "default", capacity=100) == "queued"  # behind the waiting priority request
    assert store("m3", "flex", capacity=100) == "queued"  # flex always waits for the dispatcher
    assert store("m3", "default", capacity=100) == "dispatched"  # a waiting flex request is not ahead of it
    # The API's group INSERT: rows of one statement count those of their model ahead of them.
    jobs = [
        (transitions.new_job(tenant_id=t.id, model="m4", params={}, prompts=[[1]], stream=False), None)
        for _ in range(3)
    ]
    with sessions() as s:
        rows = s.execute(transitions.INSERT, transitions.insert_group(jobs, lambda _model: 2)).all()
        s.commit()
    assert sorted(r.state for r in rows) == ["dispatched", "dispatched", "queued"]
