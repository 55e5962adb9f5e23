"""A batch's queued lines that expire or are cancelled end like every job, through the lifecycle:
each counted once in usage, its rate-limit reservation settled, a terminal event on its stream, and
a second pass changes nothing. Real Postgres and Redis, in-process (the batch keeper's own pass)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from core.batches import progress
from core.generation.events import Cancelled, Failed, decode
from core.infra import streams
from core.infra.orm import Batch, Job, UsageDaily
from core.jobs.lifecycle import Lifecycle
from core.states import BatchStatus
from core.tenancy import ratelimit
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
    ("status", "final", "event", "code"),
    [
        (BatchStatus.in_progress, BatchStatus.expired, Failed, "batch_expired"),
        (BatchStatus.cancelling, BatchStatus.cancelled, Cancelled, None),
    ],
)
def test_ended_lines_each_count_once_settle_and_announce(
    session, sessions, rds, it_settings, status, final, event, code
):
    tenant_id, batch_id, ids = _batch(session, status, key_id=77)
    # Two lines hold a reservation (dispatched once, then requeued when their worker was lost).
    held = ids[:2]
    limits = ratelimit.Limits(tpd=10_000, max_queued=100)
    assert all(d.allowed for d in ratelimit.admit_many(rds, [(tenant_id, 77, j, limits, 40) for j in held]))
    tpd_key = rds.hget(ratelimit.reservation_key(held[0]), "tpd").decode()
    active_key = rds.hget(ratelimit.reservation_key(held[0]), "active").decode()
    assert int(rds.get(tpd_key)) == 80 and rds.zcard(active_key) == 2
    lifecycle = Lifecycle(sessions, rds, it_settings)

    for _ in range(6):  # 12 lines in slices of 5: three passes end them, three more write the error file
        progress.advance(sessions, lifecycle, slice_rows=5)
    assert session.get(Batch, batch_id, populate_existing=True).status == final

    # One usage count per line, in one row (same day, tenant, key and model), every one not a success.
    assert _usage(session, tenant_id) == (LINES, LINES, 1)
    # Each line: exactly one terminal event, of its kind.
    for job_id in ids:
        evs = [decode(raw) for _, raw in streams.entries(rds, job_id)]
        assert len(evs) == 1 and isinstance(evs[0], event), (job_id, evs)
        if code is not None:
            assert evs[0].error.code == code
    # Reservations released (and the concurrency set with them).
    for job_id in held:
        assert not rds.exists(ratelimit.reservation_key(job_id))
    assert int(rds.get(tpd_key)) == 0 and rds.zcard(active_key) == 0  # nothing ran: nothing spent
    # Exactly once: more passes end nothing again.
    progress.advance(sessions, lifecycle, slice_rows=5)
    assert _usage(session, tenant_id) == (LINES, LINES, 1)
    assert all(len(streams.entries(rds, j)) == 1 for j in ids)
    states = session.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id).group_by(Job.state))
    assert dict(states.all()) == {final.value: LINES}
