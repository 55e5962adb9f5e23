"""The retention sweeper removes what is past its retention and nothing else."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from core.infra.orm import File, FileChunk, IdempotencyKey, Job
from core.jobs.states import JobState
from core.retention import sweep
from tests import factories


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
