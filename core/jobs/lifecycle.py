"""A job's life, each step written once: submit, succeed, fail, cancel, reap.

"A job ends" is always the same four things, in this order: the compare-and-set transition and
the tenant's usage row in one transaction; then the rate-limit reservation settled (the real
usage, or nothing for a job that produced nothing billable); then the terminal event that wakes
every reader of the job's stream. Whoever wins the transition does them; whoever loses (a late
worker, a second cancel, the reaper racing a finishing worker) does nothing.

The worker, the dispatcher and the API all end jobs through `Lifecycle` (the API from a thread:
one implementation beats a sync and an async copy that drift apart).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import redis
from sqlalchemy import Update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, sessionmaker

from core import idempotency
from core.config import Settings
from core.idempotency import Claim
from core.infra import kv, streams
from core.infra.broker import send_run_job
from core.infra.metrics import E2E, GENERATION_TOKENS, PROMPT_TOKENS, REAPED
from core.infra.orm import Job, JobState
from core.jobs import transitions
from core.jobs.events import Cancelled, Delta, Done, ErrorInfo, Failed, JobResult, Usage, decode, encode
from core.tenancy import ratelimit, usage

log = logging.getLogger(__name__)

# The one wording of each ending that is not the engine's own verdict.
CANCELLED = ErrorInfo(message="The job was cancelled.", type="cancelled", code="cancelled")


def worker_lost(max_attempts: int) -> ErrorInfo:
    return ErrorInfo(
        message=f"The worker running this job was lost {max_attempts} times; giving up.",
        type="server_error",
        code="worker_lost",
    )


async def submit(session: AsyncSession, job: Job, cap: int | None = None, claim: Claim | None = None) -> None:
    """Persist, then enqueue: commit the job (and the Idempotency-Key that names it), already
    `dispatched` if its tenant has room, in one transaction; then hand it to Celery. The row exists
    before any message can name it; if the send fails the dispatcher sends it later."""
    # Interactive jobs only: batch lines always go through the fair dispatcher.
    row = (await session.execute(*transitions.insert_new(job, cap, dispatch=job.kind == "interactive"))).one()
    job.state, job.created_at, job.dispatched_at = row.state, row.created_at, row.dispatched_at
    await idempotency.record(claim, job.id, session)
    await session.commit()
    if job.state != JobState.dispatched.value:  # a batch line, or over the cap: the dispatcher sends it
        return
    try:
        await anyio.to_thread.run_sync(send_run_job, job.id, job.attempt, job.model, job.kind)
    except Exception:
        log.warning("could not send job %s; leaving it to the dispatcher", job.id, exc_info=True)
        try:
            await session.execute(transitions.undispatch(job.id, job.attempt))
            await session.commit()
        except Exception:  # left `dispatched`: the dispatcher re-sends it after its timeout
            log.warning("could not return job %s to queued", job.id, exc_info=True)


class Lifecycle:
    def __init__(self, sessions: sessionmaker[Session], rds: redis.Redis, settings: Settings) -> None:
        self.sessions, self.redis, self.settings = sessions, rds, settings
        self.appender: streams.GroupAppender | None = None

    # -- events ------------------------------------------------------------------------------
    def publish(
        self, job_id: str, evs: Sequence[Delta | Done | Failed | Cancelled], *, cancel_flag: bool = False
    ) -> list[str]:
        """Append events to the job's stream in one round trip; returns their entry ids."""
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        if cancel_flag:
            pipe.set(streams.cancel_key(job_id), 1, ex=3600)
        streams.queue_append(pipe, job_id, [encode(e) for e in evs], s.events_ttl_s)
        out = pipe.execute()
        ids = out[1:-1] if cancel_flag else out[:-1]
        return [i if isinstance(i, str) else i.decode() for i in ids]

    def publish_deltas(self, job_id: str, attempt: int, evs: Sequence[Delta]) -> list[str]:
        """A running attempt's output: appended only while no newer attempt has claimed the job
        (streams.Fenced otherwise)."""
        payloads = [encode(e) for e in evs]
        if self.appender is not None:  # a worker: grouped with its other jobs' appends, one round trip
            return self.appender.append(job_id, attempt, payloads, self.settings.events_ttl_s)
        return streams.append_fenced(self.redis, job_id, attempt, payloads, self.settings.events_ttl_s)

    # -- the one way a job ends --------------------------------------------------------------
    @staticmethod
    def _record(session: Session, job: Any, outcome: str, u: Usage | None, engine_s: float) -> None:
        u = u or Usage()
        session.execute(
            usage.UPSERT,
            usage.record(
                tenant_id=job.tenant_id,
                key_id=job.key_id,
                model=job.model,
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                gpu_seconds=engine_s,
                outcome=outcome,
            ),
        )

    def _announce(self, job_id: str, billable: int, ev: Done | Failed | Cancelled) -> None:
        """After the commit: settle the reservation and publish the end, retried while Redis is away
        (the ledger already says how the job ended; readers fall back to it meanwhile)."""
        deadline = time.monotonic() + self.settings.infra_retry_s
        backoff = 0.2
        while True:
            try:
                ratelimit.settle(self.redis, job_id, billable)
                self.publish(job_id, [ev], cancel_flag=isinstance(ev, Cancelled))
                return
            except kv.TRANSIENT:
                if time.monotonic() + backoff > deadline:
                    log.warning("job %s ended but Redis stayed away: its end is in Postgres only", job_id)
                    return
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _end(
        self,
        stmt: Update | tuple[Update, dict[str, Any]],
        outcome: str,
        ev: Done | Failed | Cancelled,
        u: Usage | Callable[[Job], Usage] | None = None,
        engine_s: float = 0.0,
    ) -> Any:
        """The transition and the usage row in one transaction, then settle and announce. `u` may be
        computed from the row the transition returns (a cancel bills what was already produced).
        Returns that row (None when the transition lost)."""
        with self.sessions() as s:
            found = (s.execute(*stmt) if isinstance(stmt, tuple) else s.execute(stmt)).first()
            # A cancel returns the whole Job (the API renders it); succeed and fail only transitions.ENDED.
            row: Any = None if found is None else found[0] if len(found) == 1 else found
            if row is not None:
                if callable(u):
                    u = u(row)
                self._record(s, row, outcome, u, engine_s)
            s.commit()
        if row is not None:
            billable = u.total_tokens if isinstance(u, Usage) and outcome in ("succeeded", "cancelled") else 0
            self._announce(row.id, billable, ev)
        return row

    def produced(self, job: Job) -> Usage:
        """What a job that ends early has already cost: its prompt once processing started, and every
        token its stream carried. A client that read tokens and then cancelled pays for them."""
        generated = sum(len(e.token_ids) + bool(e.eos) for e in self._deltas(job.id))
        prompt = sum(len(p.get("ids", [])) for p in (job.prompts or [])) if job.started_at is not None else 0
        return Usage(prompt_tokens=prompt, completion_tokens=generated)

    def _deltas(self, job_id: str) -> list[Delta]:
        try:
            evs = [decode(raw) for _, raw in streams.entries(self.redis, job_id)]
        except Exception:  # Redis away: bill what Postgres knows (nothing generated is recorded there)
            log.warning("could not read %s's stream to bill a cancel", job_id, exc_info=True)
            return []
        return [e for e in evs if isinstance(e, Delta)]

    def succeed(self, job: Job, result: JobResult, u: Usage, engine_s: float) -> bool:
        stmt = transitions.succeed(job.id, job.attempt, result.model_dump(mode="json"), u.model_dump(mode="json"))
        row = self._end(stmt, "succeeded", Done(attempt=job.attempt, usage=u), u, engine_s)
        if row is not None:
            PROMPT_TOKENS.labels(row.model).inc(u.prompt_tokens)
            GENERATION_TOKENS.labels(row.model).inc(u.completion_tokens)
            if row.finished_at is not None and row.created_at is not None:
                E2E.labels(row.model, row.kind).observe((row.finished_at - row.created_at).total_seconds())
        return row is not None

    def fail(self, job: Job, error: ErrorInfo, u: Usage | None = None, engine_s: float = 0.0) -> bool:
        stmt = transitions.fail(job.id, job.attempt, error.model_dump(mode="json"))
        return self._end(stmt, "failed", Failed(attempt=job.attempt, error=error), u, engine_s) is not None

    def cancel(self, job_id: str, tenant_id: int) -> Job | None:
        """Cancel a live job of this tenant; returns its row either way (None: not this tenant's)."""
        stmt = transitions.cancel(job_id, tenant_id, CANCELLED.model_dump(mode="json"))
        row = self._end(stmt, "cancelled", Cancelled(), self.produced)
        if row is not None:
            return row
        with self.sessions() as s:
            return s.execute(transitions.get_for_tenant(job_id, tenant_id)).scalar()

    def reap(self) -> dict[str, int]:
        """Jobs whose worker stopped renewing its lease: back to `queued` with the next attempt (the
        next attempt resumes from the streamed tokens), or failed once attempts run out."""
        n = self.settings.max_attempts
        err = worker_lost(n)
        with self.sessions() as s:
            requeued_rows = s.execute(transitions.requeue_lapsed(n)).all()
            failed = s.execute(transitions.fail_lapsed(n, err.model_dump(mode="json"))).scalars().all()
            for row in failed:
                self._record(s, row, "failed", None, 0.0)
            s.commit()
        requeued = len(requeued_rows)
        for r in requeued_rows:
            REAPED.labels(r.model).inc()
        for row in failed:
            REAPED.labels(row.model).inc()
        for row in failed:
            self._announce(row.id, 0, Failed(attempt=row.attempt, error=err))
        return {"requeued": requeued, "failed": len(failed)}
