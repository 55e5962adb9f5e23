"""Persist, then enqueue; and the dispatcher loop that owns everything the happy path missed.

- The API commits a job as `queued`, then moves it to `dispatched` and sends its message. If the
  send fails, the job goes back to `queued` and the dispatcher sends it.
- The dispatcher (`spool dispatcher`; running two is safe, every pick uses SKIP LOCKED) sends
  `queued` jobs, re-sends `dispatched` jobs nobody claimed (lost messages), and returns jobs whose
  worker stopped renewing its lease to `queued` with the next attempt number.
"""

from __future__ import annotations

import logging
import time

import anyio
import redis
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, sessionmaker

from core import events, jobs
from core.models import Job
from core.queue import queue_for, send_run_job
from core.settings import Settings

log = logging.getLogger(__name__)


async def submit(session: AsyncSession, job: Job) -> None:
    """Commit the job, then hand it to Celery. The row exists before any message can name it."""
    session.add(job)
    await session.commit()
    moved = (await session.execute(jobs.mark_dispatched(job.id, job.attempt))).first()
    await session.commit()
    if moved is None:  # cancelled in between, or the dispatcher already took it
        return
    try:
        await anyio.to_thread.run_sync(send_run_job, job.id, job.attempt, job.model)
    except Exception:
        log.warning("could not send job %s; leaving it to the dispatcher", job.id, exc_info=True)
        await session.execute(jobs.undispatch(job.id, job.attempt))
        await session.commit()


def tick(session: Session, rds: redis.Redis, broker: redis.Redis, settings: Settings) -> dict[str, int]:
    """One pass of the dispatcher. Returns counts for logs and tests."""
    requeued = session.execute(jobs.requeue_lapsed(settings.max_attempts)).all()
    failed = session.execute(jobs.fail_lapsed(settings.max_attempts)).all()
    session.commit()
    for job_id, attempt in failed:  # wake anyone waiting on these jobs
        pipe = rds.pipeline(transaction=False)
        events.queue_append(
            pipe,
            job_id,
            [
                {
                    "type": "error",
                    "attempt": attempt,
                    "error": {
                        "message": "The worker running this job was lost too many times.",
                        "type": "server_error",
                        "param": None,
                        "code": "worker_lost",
                    },
                }
            ],
            settings.events_ttl_s,
            settings.events_maxlen,
        )
        pipe.execute()

    # Only where the model's queue is empty: a message still waiting in a busy queue is slow, not
    # lost, and re-sending it would pile duplicates onto the backlog.
    idle = [m for m in settings.model_ids if broker.llen(queue_for(m)) == 0]
    stale = session.execute(
        jobs.touch_stale_dispatched(settings.dispatch_timeout_s, settings.dispatcher_batch, idle)
    ).all()
    session.commit()
    picked = session.execute(jobs.take_queued(settings.dispatcher_batch)).all()
    session.commit()
    sent = 0
    for job_id, attempt, model in [*stale, *picked]:
        try:
            send_run_job(job_id, attempt, model)
            sent += 1
        except Exception:
            log.warning("send failed for %s; back to queued", job_id, exc_info=True)
            session.execute(jobs.undispatch(job_id, attempt))
            session.commit()
    counts = {"requeued": len(requeued), "failed": len(failed), "resent": len(stale), "sent": sent}
    if any(counts.values()):
        log.info("dispatcher: %s", counts)
    return counts


def run_forever(sessions: sessionmaker, rds: redis.Redis, settings: Settings) -> None:
    log.info("dispatcher started (every %.1fs)", settings.dispatcher_interval_s)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    while True:
        started = time.monotonic()
        try:
            with sessions() as session:
                tick(session, rds, broker, settings)
        except Exception:
            log.exception("dispatcher tick failed; retrying")
        time.sleep(max(0.0, settings.dispatcher_interval_s - (time.monotonic() - started)))
