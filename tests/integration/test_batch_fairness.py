"""No tenant holds the others hostage in shared batch work (issue 35): the batch keeper looks at every
live batch, fairly across tenants and capped per tenant, and webhook claims are fair across tenants.

Real Postgres and Redis, in-process: the keeper's pass (`progress.advance`) and the dispatcher's
webhook claim (`webhooks.claim_due`). The database is shared with the other integration tests, so
every assertion is about this test's own tenants."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from core.batches import progress, webhooks
from core.batches.transitions import cancel_requested
from core.generation.events import ChoiceResult, JobResult, Usage
from core.infra.orm import Batch, Job, Tenant
from core.jobs.lifecycle import Lifecycle
from core.states import FINAL, BatchStatus, JobState
from ops import factories


@pytest.fixture
def tenant(session, sessions) -> Iterator:
    """Makes tenants for one test and removes them after it (their batches and lines with them), so
    that the other tests' dispatch ticks and webhook claims never meet this test's rows."""
    made: list[int] = []

    def make() -> Tenant:
        t = factories.tenant(session)
        made.append(t.id)
        return t

    yield make
    session.rollback()
    factories.remove_tenants(sessions, made)


def _status(session, batch_id: str) -> str:
    return session.get(Batch, batch_id, populate_existing=True).status


def _states(session, batch_id: str) -> dict[str, int]:
    session.expire_all()
    rows = session.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id).group_by(Job.state))
    return dict(rows.all())


def _succeed_lines(session, lifecycle: Lifecycle, batch_id: str) -> None:
    """Every line of the batch runs and succeeds, as a worker would leave it."""
    for (job_id,) in session.execute(select(Job.id).where(Job.batch_id == batch_id)).all():
        job = session.get(Job, job_id, populate_existing=True)
        job.state, job.started_at = JobState.running.value, datetime.now(UTC)
        job.lease_until = datetime.now(UTC) + timedelta(seconds=60)
        session.commit()
        result = JobResult(choices=[ChoiceResult(index=0, text="ok", finish_reason="length")])
        assert lifecycle.succeed(job, result, Usage(completion_tokens=1), 0.1)


def test_a_young_batch_of_another_tenant_ends_while_25_older_ones_stay_live(
    session, sessions, rds, it_settings, tenant
):
    """Before: the keeper looked at the 20 oldest live batches only; while they stayed live (lines
    queued behind a busy GPU), no younger batch of anyone was finalized, expired or cancelled."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    x = tenant()
    for _ in range(25):
        factories.batch(session, x, lines=1)  # a line still queued: live, nothing for the keeper to do
    y = tenant()
    young = factories.batch(session, y, lines=1).id
    _succeed_lines(session, lifecycle, young)
    progress.advance(sessions, lifecycle)
    if _status(session, young) not in FINAL:
        progress.advance(sessions, lifecycle)
    assert _status(session, young) == BatchStatus.completed
    b = session.get(Batch, young)
    assert progress.counts(b) == {"total": 1, "completed": 1, "failed": 0} and b.output_file_id is not None


def test_a_cancel_stops_queued_lines_at_once_among_many_live_batches(session, sessions, rds, it_settings, tenant):
    """Before: a cancelled batch younger than 20 live ones kept its queued lines (they went on being
    dispatched and billed) until older batches ended. Batches needing the keeper come first."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    x = tenant()
    for _ in range(25):
        factories.batch(session, x, lines=1)
    cancelled = factories.batch(session, x, lines=3).id
    session.execute(cancel_requested(cancelled, datetime.now(UTC)))
    session.commit()
    progress.advance(sessions, lifecycle)
    assert _states(session, cancelled) == {JobState.cancelled.value: 3}
    assert _status(session, cancelled) == BatchStatus.cancelled


def test_one_tenants_batches_share_one_slice_a_pass(session, sessions, rds, it_settings, tenant):
    """Five expired batches of X and one of Y, slices of 5 lines: a pass ends at most 5 of X's lines
    (before: 5 per batch, any number of batches), Y's lines all end in that same pass, and passes
    with a kept rotation work through all of them."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    x, y = tenant(), tenant()
    xs = [factories.batch(session, x, lines=4, window_left_s=-4).id for _ in range(5)]
    ys = factories.batch(session, y, lines=4, window_left_s=-4).id
    rotation = progress.Rotation()
    done = progress.advance(sessions, lifecycle, slice_rows=5, rotation=rotation)
    ended_x = sum(_states(session, b).get(JobState.expired.value, 0) for b in xs)
    assert ended_x <= 5
    assert _states(session, ys) == {JobState.expired.value: 4}
    assert done.more  # X has more to do: the keeper comes back at once
    for _ in range(30):
        if all(_status(session, b) in FINAL for b in [*xs, ys]):
            break
        progress.advance(sessions, lifecycle, slice_rows=5, rotation=rotation)
    assert {_status(session, b) for b in [*xs, ys]} == {BatchStatus.expired}
    assert all(progress.counts(session.get(Batch, b)) == {"total": 4, "completed": 0, "failed": 4} for b in xs)


def test_each_pass_goes_on_where_the_tenants_last_pass_stopped(session, sessions, rds, it_settings, tenant):
    """A tenant's first batches wait on a running line each (cancelled, nothing for the keeper to do
    until it ends); the ones after them have queued lines to cancel. With a cap of 3 batches a pass,
    the next pass goes on after the first three, not back to them."""
    lifecycle = Lifecycle(sessions, rds, it_settings)
    x = tenant()
    stuck = [factories.batch(session, x, lines=1, status=BatchStatus.cancelling).id for _ in range(3)]
    for b in stuck:
        job = session.scalars(select(Job).where(Job.batch_id == b)).one()
        job.state, job.started_at = JobState.running.value, datetime.now(UTC)
        job.lease_until = datetime.now(UTC) + timedelta(seconds=600)
    session.commit()
    waiting = [factories.batch(session, x, lines=2, status=BatchStatus.cancelling).id for _ in range(3)]
    rotation = progress.Rotation()
    for _ in range(2):
        progress.advance(sessions, lifecycle, rotation=rotation, per_tenant=3)
    assert all(_status(session, b) == BatchStatus.cancelled for b in waiting)
    assert all(_states(session, b) == {JobState.cancelled.value: 2} for b in waiting)
    assert all(_status(session, b) == BatchStatus.cancelling for b in stuck)  # their running line still runs


def test_one_tenants_300_due_webhooks_never_hold_another_tenants_back(session, tenant):
    """Before: a claim took the 50 oldest due deliveries, and a tenant's third in flight was deferred
    with its attempt given back: X's 300 ended batches and slow receiver kept Y's webhook out for hours."""
    x, y = tenant(), tenant()
    hook = "http://127.0.0.1:9/hook"
    for _ in range(300):
        factories.batch(session, x, status=BatchStatus.completed, webhook_url=hook)
    mine = factories.batch(session, y, status=BatchStatus.completed, webhook_url=hook).id
    claimed = webhooks.claim_due(session, lease_s=60)
    assert mine in [b.id for b in claimed]
    assert len([b for b in claimed if b.tenant_id == x.id]) == webhooks.PER_TENANT_IN_FLIGHT
    # X's two are in flight: the next claims take none of X's until one reports back or lapses.
    again = webhooks.claim_due(session, lease_s=60)
    assert [b for b in again if b.tenant_id in (x.id, y.id)] == []
    first = next(b for b in claimed if b.tenant_id == x.id)
    session.expire_all()
    state = session.get(Batch, first.id).webhook_state
    session.get(Batch, first.id).webhook_state = {k: v for k, v in state.items() if k not in ("next_at", "lease")} | {
        "delivered": datetime.now(UTC).isoformat()
    }
    session.commit()
    third = [b for b in webhooks.claim_due(session, lease_s=60) if b.tenant_id == x.id]
    assert len(third) == 1 and third[0].id not in {b.id for b in claimed}
