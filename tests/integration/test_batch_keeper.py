"""Batch bookkeeping off the dispatcher's tick, in slices (issue 25)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from core.batches import progress
from core.batches.status import BatchStatus
from core.dispatcher import Dispatcher
from core.infra.orm import Batch, Job
from core.jobs.lifecycle import Lifecycle
from tests import factories


def _expired_batch(session, lines: int) -> str:
    t = factories.tenant(session)
    now = datetime.now(UTC)
    b = Batch(
        id=progress.new_batch_id(),
        tenant_id=t.id,
        endpoint="/v1/completions",
        input_file_id="file-x",
        completion_window="1s",
        status=BatchStatus.in_progress.value,
        created_at=now - timedelta(seconds=5),
        in_progress_at=now - timedelta(seconds=5),
        expires_at=now - timedelta(seconds=4),
    )
    session.add(b)
    session.commit()
    for i in range(lines):
        j = factories.job(session, t, kind="batch")
        j.batch_id, j.line_no, j.custom_id = b.id, i + 1, f"r{i}"
    session.commit()
    return b.id


def _states(session, batch_id: str) -> dict[str, int]:
    session.expire_all()
    rows = session.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id).group_by(Job.state))
    return dict(rows.all())


def test_an_expired_batch_is_worked_through_in_slices(session, sessions, rds, it_settings):
    lifecycle = Lifecycle(sessions, rds, it_settings)
    batch_id = _expired_batch(session, 12)
    progress.advance(session, lifecycle, slice_rows=5)
    assert _states(session, batch_id) == {"expired": 5, "queued": 7}
    assert session.get(Batch, batch_id).status == BatchStatus.in_progress  # not finalized meanwhile
    progress.advance(session, lifecycle, slice_rows=5)
    progress.advance(session, lifecycle, slice_rows=5)
    assert _states(session, batch_id) == {"expired": 12}
    b = session.get(Batch, batch_id)
    assert b.status == BatchStatus.expired and b.request_counts == {"total": 12, "completed": 0, "failed": 12}
    assert b.error_file_id is not None


def test_the_dispatch_tick_does_no_batch_bookkeeping(session, sessions, rds, it_settings, monkeypatch):
    """Before: every tick expired and rendered batches itself, holding dispatch, reaping and re-sends."""
    batch_id = _expired_batch(session, 3)

    def refuse(*_a, **_k):
        raise AssertionError("batch bookkeeping inside the dispatch tick")

    d = Dispatcher(sessions, rds, rds, it_settings)
    monkeypatch.setattr(d, "_send", lambda _s, rows: len(rows))  # no Celery here
    monkeypatch.setattr(progress, "advance", refuse)
    d.tick()
    assert _states(session, batch_id) == {"queued": 3}
    monkeypatch.undo()
    d.keep_batches()  # the keeper thread's pass does it
    assert _states(session, batch_id) == {"expired": 3}
