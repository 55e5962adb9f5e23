"""A batch's queued lines that expire or are cancelled end like every job, through the lifecycle:
each counted once in usage, its rate-limit reservation settled, its ending on its row and nothing
of it left in Redis, and a second pass changes nothing. Real Postgres and Redis, in-process (the
batch keeper's own pass)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from core.batches import progress
from core.infra.orm import Batch, Job, UsageDaily
from core.infra.streams import keys
from core.jobs.lifecycle import Lifecycle
from core.states import BatchStatus, JobState
from core.tenancy import limits
from ops import factories

LINES = 12


def _batch(session, status: BatchStatus, key_id: int | None) -> tuple[int, str, list[str]]:
    t = factories.tenant(session)
    expired = status == BatchStatus.in_progress
    b = factories.batch(session, t, status=status, lines=LINES, window_left_s=-4 if expired else 3600, key_id=key_id)
    ids = session.scalars(select(Job.id).where(Job.batch_id == b.id).order_by(Job.line_no)).all()
    return t.id, b.id, list(ids)


def _usage(session, tenant_id: int) -> tuple[int, int, int]:
    session.expire_all()
    row = session.execute(
        select(func.sum(UsageDaily.requests), func.sum(UsageDaily.failed), func.count()).where(
            UsageDaily.tenant_id == tenant_id
        )
    ).one()
    return int(row[0] or 0), int(row[1] or 0), int(row[2])


@pytest.mark.parametrize(
    ("status", "final", "state", "code"),
    [
        (BatchStatus.in_progress, BatchStatus.expired, JobState.expired, "batch_expired"),
        (BatchStatus.cancelling, BatchStatus.cancelled, JobState.cancelled, "batch_cancelled"),
    ],
)
def test_ended_lines_each_count_once_settle_and_announce(
    session, sessions, rds, it_settings, status, final, state, code
):
    tenant_id, batch_id, ids = _batch(session, status, key_id=77)
    # Two lines hold a reservation (dispatched once, then requeued when their worker was lost).
    held = ids[:2]
    caps = limits.Limits(tpd=10_000, max_queued=100)
    assert all(d.allowed for d in limits.admit_many(rds, [(tenant_id, 77, j, caps, 40) for j in held]))
    tpd_key = rds.hget(limits.reservation_key(held[0]), "tpd").decode()
    active_key = rds.hget(limits.reservation_key(held[0]), "active").decode()
    assert int(rds.get(tpd_key)) == 80 and rds.zcard(active_key) == 2
    lifecycle = Lifecycle(sessions, rds, it_settings)

    for _ in range(6):  # 12 lines in slices of 5: three passes end them, three more write the error file
        progress.advance(sessions, lifecycle, slice_rows=5)
    assert session.get(Batch, batch_id, populate_existing=True).status == final

    # One usage count per line, in one row (same day, tenant, key and model), every one not a success.
    assert _usage(session, tenant_id) == (LINES, LINES, 1)
    # Each line: its ending, of its kind, on its row; nothing of it in Redis (issue 49: a line that
    # never ran left a 4.8 KB stream for minutes and its marks for a day).
    for job_id in ids:
        row = session.get(Job, job_id, populate_existing=True)
        assert (row.state, row.error["code"]) == (state.value, code)
        assert not rds.exists(keys.stream_key(job_id), keys.marks_key(job_id)), job_id
    # Reservations released (and the concurrency set with them).
    for job_id in held:
        assert not rds.exists(limits.reservation_key(job_id))
    assert int(rds.get(tpd_key)) == 0 and rds.zcard(active_key) == 0  # nothing ran: nothing spent
    # Exactly once: more passes end nothing again.
    progress.advance(sessions, lifecycle, slice_rows=5)
    assert _usage(session, tenant_id) == (LINES, LINES, 1)
    assert not any(rds.exists(keys.stream_key(j)) for j in ids)
    states = session.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id).group_by(Job.state))
    assert dict(states.all()) == {final.value: LINES}
