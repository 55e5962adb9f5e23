"""The retention sweeper: what Spool keeps, and for how long (run by the dispatcher every minute).

- files past `expires_at` (uploads and batch result files: 30 days after their creation, or the
  upload's `expires_after` / the batch's `output_expires_after`, core/files/expiry.py): content
  deleted (and no longer counted to the tenant's storage), the row kept as `deleted` for batches
  that name it, so the file is a 404 from then on;
- finished jobs older than `SPOOL_RETENTION_JOBS_DAYS` (batch lines once their batch has ended);
- batches that ended (completed, failed, expired, cancelled) more than `SPOOL_RETENTION_BATCHES_DAYS`
  ago, once none of their lines is left (so a line is never left without the batch that lets it go);
- Idempotency-Keys older than `SPOOL_IDEMPOTENCY_TTL_H`.
Event streams expire in Redis by themselves (`SPOOL_EVENTS_TTL_S`). Each step deletes in slices, so
a large backlog never holds long locks.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import delete, exists, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from core import idempotency
from core.config import Settings
from core.infra.orm import Batch, File, FileChunk, Job
from core.states import FINAL, JobState

log = logging.getLogger(__name__)
TERMINAL = [JobState.succeeded.value, JobState.failed.value, JobState.cancelled.value, JobState.expired.value]


def sweep(sessions: sessionmaker[Session], settings: Settings, slice_rows: int = 5000) -> dict[str, int]:
    counts = {"files": 0, "jobs": 0, "batches": 0, "keys": 0}
    with sessions() as s:
        expired = s.scalars(
            select(File.id)
            .where(File.deleted.is_(False), File.expires_at.isnot(None), File.expires_at < func.now())
            .limit(slice_rows)
        ).all()
        if expired:
            s.execute(delete(FileChunk).where(FileChunk.file_id.in_(expired)))
            s.execute(update(File).where(File.id.in_(expired)).values(deleted=True))
        counts["files"] = len(expired)
        cutoff = func.now() - timedelta(days=settings.retention_jobs_days)
        old = (
            select(Job.id)
            .outerjoin(Batch, Batch.id == Job.batch_id)
            .where(
                Job.state.in_(TERMINAL),
                Job.finished_at < cutoff,
                # A line goes once its batch has ended (or is gone: nothing could end it any more).
                or_(Job.batch_id.is_(None), Batch.id.is_(None), Batch.status.in_([b.value for b in FINAL])),
            )
            .limit(slice_rows)
        )
        counts["jobs"] = len(s.execute(delete(Job).where(Job.id.in_(old.scalar_subquery())).returning(Job.id)).all())
        # Batches after their lines (this sweep's deletions included): one probe of ix_jobs_batch_state each.
        ended_at = func.coalesce(Batch.completed_at, Batch.failed_at, Batch.expired_at, Batch.cancelled_at)
        ended = (
            select(Batch.id)
            .where(
                Batch.status.in_([b.value for b in FINAL]),
                ended_at < func.now() - timedelta(days=settings.retention_batches_days),
                ~exists().where(Job.batch_id == Batch.id),
            )
            .limit(slice_rows)
        )
        gone = s.execute(delete(Batch).where(Batch.id.in_(ended.scalar_subquery())).returning(Batch.id)).all()
        counts["batches"] = len(gone)
        keys = idempotency.expired(settings.idempotency_ttl_h).returning(idempotency.IdempotencyKey.key)
        counts["keys"] = len(s.execute(keys).all())
        s.commit()
    if any(counts.values()):
        log.info("retention: removed %s", counts)
    return counts
