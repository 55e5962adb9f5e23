"""The retention sweeper removes what is past its retention and nothing else."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from core.infra.orm import File, FileChunk, IdempotencyKey, Job
from core.retention import sweep
from core.states import JobState
from ops import factories


def test_sweeper_removes_old_jobs_expired_files_and_old_keys(session, sessions, it_settings):
    t = factories.tenant(session)
    now = datetime.now(UTC)
    old = factories.job(session, t, state=JobState.succeeded)
    recent = factories.job(session, t, state=JobState.succeeded)
    live = factories.job(session, t, state=JobState.queued)
    old.finished_at, recent.finished_at = now - timedelta(days=40), now - timedelta(days=1)
    gone = File(id="file-old", tenant_id=t.id, purpose="batch", filename="a", expires_at=now - timedelta(days=1))
    kept = File(id="file-new", tenant_id=t.id, purpose="batch", filename="b", expires_at=now + timedelta(days=1))
    session.add_all([gone, kept])
    session.flush()
    session.add_all([FileChunk(file_id="file-old", seq=0, data=b"x"), FileChunk(file_id="file-new", seq=0, data=b"y")])
    session.add_all(
        [
            IdempotencyKey(
                tenant_id=t.id, key="old", endpoint="e", request_hash="h", created_at=now - timedelta(days=2)
            ),
            IdempotencyKey(tenant_id=t.id, key="new", endpoint="e", request_hash="h"),
        ]
    )
    session.commit()
    old_id, recent_id, live_id, tid = old.id, recent.id, live.id, t.id
    counts = sweep(sessions, it_settings)
    assert counts["jobs"] >= 1 and counts["files"] >= 1 and counts["keys"] >= 1
    session.expire_all()
    session.expunge_all()
    assert session.get(Job, old_id) is None
    assert session.get(Job, recent_id) is not None and session.get(Job, live_id) is not None
    assert session.get(File, "file-old").deleted and session.get(FileChunk, ("file-old", 0)) is None
    assert not session.get(File, "file-new").deleted and session.get(FileChunk, ("file-new", 0)) is not None
    assert session.get(IdempotencyKey, (tid, "old")) is None and session.get(IdempotencyKey, (tid, "new"))


def test_sweeper_removes_batches_ended_past_retention_once_their_lines_are_gone(session, sessions, it_settings):
    """Before: batch rows were never swept. Now an ended batch goes `retention_batches_days` after it
    ended, after its lines (so no line is left without the batch that lets it be swept)."""
    from core.infra.orm import Batch
    from core.states import BatchStatus

    t = factories.tenant(session)
    now = datetime.now(UTC)
    long_ago = now - timedelta(days=it_settings.retention_batches_days + 10)
    gone = factories.batch(session, t, status=BatchStatus.completed, completed_at=long_ago)
    failed = factories.batch(session, t, status=BatchStatus.failed, failed_at=long_ago)
    recent = factories.batch(session, t, status=BatchStatus.cancelled, cancelled_at=now - timedelta(days=1))
    live = factories.batch(session, t, status=BatchStatus.in_progress, lines=1)
    live.created_at = long_ago
    # Ended long ago, but a line of it finished recently (retention of jobs not reached): kept for now.
    waits = factories.batch(session, t, status=BatchStatus.expired, lines=1, expired_at=long_ago)
    line = session.scalars(select(Job).where(Job.batch_id == waits.id)).one()
    line.state, line.finished_at = JobState.expired.value, now - timedelta(days=1)
    session.commit()
    ids = {b.id for b in (gone, failed, recent, live, waits)}
    line_id, recent_id, live_id, waits_id = line.id, recent.id, live.id, waits.id
    counts = sweep(sessions, it_settings)
    assert counts["batches"] >= 2
    session.expire_all()
    left = set(session.scalars(select(Batch.id).where(Batch.id.in_(ids))).all())
    assert left == {recent_id, live_id, waits_id}
    # Once its line is past the jobs' retention, the line goes, then the batch in the same sweep.
    line = session.get(Job, line_id)
    line.finished_at = long_ago
    session.commit()
    sweep(sessions, it_settings)
    session.expire_all()
    assert set(session.scalars(select(Batch.id).where(Batch.id.in_(ids))).all()) == {recent_id, live_id}
    assert session.get(Job, line_id) is None
