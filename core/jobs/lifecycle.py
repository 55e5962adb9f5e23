"""How a job ends, each way written once: succeed, fail, cancel, reap (a job's start, persist then
enqueue, is core/jobs/submit.py's).

"A job ends" is always the same four things, in this order: the compare-and-set transition and
the tenant's usage row in one transaction; then the rate-limit reservation settled (the real
usage, or nothing for a job that produced nothing billable); then the terminal event that wakes
every reader of the job's stream (a job that never wrote one leaves nothing in Redis: its readers
hear the row at their next silence). The marks of the job's stream (where each entry left off, so a
resume from any event id is placed in the row's text once the stream has expired) are read just
before the transition and written by it, on the row (`_marks`). Whoever wins the transition does
them; whoever loses (a late worker, a second cancel, the reaper racing a finishing worker) does nothing.

The worker, the dispatcher and the API all end jobs through `Lifecycle` (the API from a thread:
one implementation beats a sync and an async copy that drift apart).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from sqlalchemy import Update
from sqlalchemy.orm import Session, sessionmaker

from core.config import Settings
from core.generation.events import (
    Cancelled,
    ChoiceResult,
    Delta,
    Done,
    ErrorInfo,
    Failed,
    JobResult,
    Usage,
    decode,
    encode,
    inline_result,
)
from core.generation.prompt import Prompt
from core.infra import transient
from core.infra.autocommit import one_statement
from core.infra.backoff import Backoff, retry
from core.infra.metrics import E2E, GENERATION_TOKENS, PROMPT_TOKENS, REAPED
from core.infra.orm import Job
from core.infra.streams import keys, write
from core.jobs import transitions
from core.jobs.transitions import Claimed
from core.states import Ending
from core.tenancy import limits, usage

log = logging.getLogger(__name__)

# The one wording of each ending that is not the engine's own verdict.
CANCELLED = ErrorInfo(message="The job was cancelled.", type="cancelled", code="cancelled")
BATCH_EXPIRED = ErrorInfo(
    message="This line was not run before the batch's completion window ended.", type="expired", code="batch_expired"
)
BATCH_CANCELLED = ErrorInfo(
    message="This line was not run: the batch was cancelled.", type="cancelled", code="batch_cancelled"
)
# How a batch's queued lines may end without running (`end_queued_lines`), each with its wording.
LINE_ENDINGS = {Ending.expired: BATCH_EXPIRED, Ending.cancelled: BATCH_CANCELLED}
# Terminal events of many jobs at once go to Redis in pipelines of this many jobs.
ANNOUNCE_CHUNK = 1000
# A worker's endings, each with its usage row, as one statement (built once).
SUCCEED = usage.billed_with(transitions.SUCCEED)
FAIL = usage.billed_with(transitions.FAIL)


def worker_lost(max_attempts: int) -> ErrorInfo:
    return ErrorInfo(
        message=f"The worker running this job was lost {max_attempts} times; giving up.",
        type="server_error",
        code="worker_lost",
    )


class Lifecycle:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        rds: redis.Redis,
        settings: Settings,
        appender: write.GroupAppender | None = None,
    ) -> None:
        """`appender`: a worker's, grouping every running job's appends into one round trip a step."""
        self.sessions, self.redis, self.settings = sessions, rds, settings
        self.appender = appender

    # -- events ------------------------------------------------------------------------------
    def publish(
        self, job_id: str, evs: Sequence[Delta | Done | Failed | Cancelled], *, cancel_flag: bool = False
    ) -> list[str]:
        """Append events to the job's stream in one round trip; returns their entry ids."""
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        if cancel_flag:
            pipe.set(keys.cancel_key(job_id), 1, ex=3600)
        write.queue_append(pipe, job_id, [encode(e) for e in evs], s.events_ttl_s)
        out = pipe.execute()
        ids = out[1:-1] if cancel_flag else out[:-1]
        return [i if isinstance(i, str) else i.decode() for i in ids]

    def publish_deltas(self, job_id: str, attempt: int, evs: Sequence[Delta], start: int) -> list[str]:
        """A running attempt's output, as the job's entries number `start`... (1-based, positional
        ids: a retried append writes nothing twice): appended only while no newer attempt has
        claimed the job (write.Fenced otherwise)."""
        payloads, ttl = [encode(e) for e in evs], self.settings.events_ttl_s
        if self.appender is not None:  # a worker: grouped with its other jobs' appends, one round trip
            return self.appender.append(job_id, attempt, payloads, ttl, start)
        return write.append_fenced(self.redis, job_id, attempt, payloads, ttl, start)

    # -- the one way a job ends --------------------------------------------------------------
    @staticmethod
    def _record(session: Session, job: Any, outcome: Ending, u: Usage | None, engine_s: float) -> None:
        session.execute(usage.UPSERT, Lifecycle._counted(job, outcome, u or Usage(), engine_s))

    @staticmethod
    def _counted(job: Any, outcome: Ending, u: Usage, engine_s: float) -> dict[str, Any]:
        """The usage counters (metrics) for one ended job; returns its usage row's parameters."""
        return usage.record(
            tenant_id=job.tenant_id,
            key_id=job.key_id,
            model=job.model,
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            gpu_seconds=engine_s,
            outcome=outcome,
            service_tier=getattr(job, "service_tier", None) or "default",
        )

    @staticmethod
    def _record_many(session: Session, rows: Sequence[Any], outcome: Ending) -> None:
        """One usage count per job for many jobs that ended alike with nothing billable (a batch's
        lines that never ran): one upsert per (tenant, key, model), in the caller's transaction."""
        groups: dict[tuple[int, int | None, str, str], int] = {}
        for r in rows:
            k = (r.tenant_id, r.key_id, r.model, getattr(r, "service_tier", None) or "default")
            groups[k] = groups.get(k, 0) + 1
        params = [
            usage.record(tenant_id=t, key_id=key, model=m, outcome=outcome, requests=n, service_tier=tier)
            for (t, key, m, tier), n in groups.items()
        ]
        if params:
            session.execute(usage.UPSERT, params)

    def _announce(self, row: Any, billable: int, ev: Done | Failed | Cancelled) -> None:
        """After the commit: settle the reservation and publish the end (on the job's stream, if it
        wrote one: `write.queue_end`), retried while Redis is away (the ledger already says how the
        job ended; readers fall back to it meanwhile). `row`: the ended job (id, tenant_id)."""
        job_id = row.id
        # Only a job a worker had claimed can be running somewhere: one cancelled before that leaves
        # no flag (a later claim loses its compare-and-set in Postgres).
        flag = isinstance(ev, Cancelled) and getattr(row, "started_at", True) is not None

        def once() -> None:
            # One round trip: the settlement, then the event (a pipeline runs them in this order).
            pipe = self.redis.pipeline(transaction=False)
            pipe.eval(limits.SETTLE, 1, limits.reservation_key(job_id), int(time.time() * 1000), billable)
            if flag:
                pipe.set(keys.cancel_key(job_id), 1, ex=3600)
            write.queue_end(pipe, job_id, row.tenant_id, [encode(ev)], self.settings.ended_events_ttl_s)
            pipe.execute()

        self._while_redis_away(once, f"job {job_id}")

    def _announce_many(self, ends: Sequence[tuple[str, int, Failed | Cancelled]]) -> None:
        """`_announce` for many jobs that billed nothing (job id, tenant, event): their reservations
        released and their terminal events appended in pipelines, not a round trip per job."""
        ttl = self.settings.ended_events_ttl_s
        for i in range(0, len(ends), ANNOUNCE_CHUNK):
            chunk = ends[i : i + ANNOUNCE_CHUNK]

            def once(chunk: Sequence[tuple[str, int, Failed | Cancelled]] = chunk) -> None:
                now_ms = int(time.time() * 1000)
                pipe = self.redis.pipeline(transaction=False)
                for job_id, tenant_id, ev in chunk:
                    pipe.eval(limits.SETTLE, 1, limits.reservation_key(job_id), now_ms, 0)
                    write.queue_end(pipe, job_id, tenant_id, [encode(ev)], ttl)
                pipe.execute()

            self._while_redis_away(once, f"{len(chunk)} jobs")

    def _marks(self, job_id: str, strict: bool = False) -> str | None:
        """The marks of the job's stream as it stands (`write.marks_of`: a few bytes a delta), for
        the ending about to be written: its row keeps them for as long as it exists, and nothing of
        the ended job outlives its stream in Redis. Read before the statement, whose compare-and-set
        may still lose (a wasted read, nothing written). Redis away: None, the ending goes on (a
        resume from an id after the stream expired is then refused as expired), unless `strict`
        (the caller retries the whole ending later)."""
        try:
            return write.marks_of(self.redis, job_id)
        except transient.REDIS:
            if strict:
                raise
            log.warning("could not read %s's stream marks: its row keeps none", job_id, exc_info=True)
        except redis.exceptions.ResponseError:  # its key is not a stream (written by hand)
            log.warning("%s's stream could not be marked", job_id, exc_info=True)
        return None

    def _while_redis_away(self, fn: Callable[[], None], what: str) -> None:
        def gave_up(_exc: Exception) -> None:
            log.warning("%s ended but Redis stayed away: the end is in Postgres only", what)

        # No lease to keep here (the job has ended): pauses up to the full 5 s.
        retry(fn, Backoff(self.settings.infra_retry_s), retry_on=transient.REDIS, give_up=gave_up)

    def _end(
        self,
        stmt: Update | tuple[Update, dict[str, Any]],
        outcome: Ending,
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
            # Billing follows delivery: whatever the ending, the reservation settles to what was billed.
            billable = u.total_tokens if isinstance(u, Usage) else 0
            self._announce(row, billable, ev)
        return row

    def produced(self, job: Job, deltas: Sequence[Delta] | None = None) -> Usage:
        """What a job that ends early has already cost: its prompt once processing started, and every
        token its stream carried. A client that read tokens and then cancelled pays for them."""
        deltas = self._deltas(job.id) if deltas is None else deltas
        generated = sum(len(e.token_ids) + bool(e.eos) for e in deltas)
        prompt = sum(len(Prompt.from_json(p).ids) for p in (job.prompts or [])) if job.started_at is not None else 0
        return Usage(prompt_tokens=prompt, completion_tokens=generated)

    def _cancelled(self, job: Job) -> Usage:
        """What a cancelled job produced, billed (`produced`) and kept on its row, in the cancel's
        transaction: its usage, and each choice's text so far as its `result` (no finish reason), so
        a cancelled job (a cancelled response) shows what it generated after its stream is gone.
        Redis away: nothing generated is known, and the row keeps a usage of 0."""
        deltas = self._deltas(job.id)
        u = self.produced(job, deltas)
        transitions.keep_cancelled(job, u.model_dump(mode="json"), partial_result(deltas))
        # Read after the deltas: marks a worker's late append adds cover text the row lacks, which a
        # resume from them simply finds delivered. A job no worker claimed wrote no stream.
        transitions.keep_marks(job, self._marks(job.id) if job.started_at is not None else None)
        return u

    def delivered(self, job: Any) -> Usage:
        """What a job's stream carried to its readers: every token in it, and the prompt once any of
        it went out (the prompt was processed to produce it). A job that streamed and then failed, or
        whose last worker was lost, bills this: billing follows delivery. Raises while Redis is away
        (the caller retries: a bill of 0 for delivered tokens would be wrong, not merely late)."""
        deltas = self._deltas(job.id, strict=True)
        if not deltas:
            return Usage()
        generated = sum(len(e.token_ids) + bool(e.eos) for e in deltas)
        prompt = sum(len(Prompt.from_json(p).ids) for p in (job.prompts or []))
        return Usage(prompt_tokens=prompt, completion_tokens=generated)

    def _deltas(self, job_id: str, strict: bool = False) -> list[Delta]:
        try:
            evs = [decode(raw) for _, raw in write.entries(self.redis, job_id)]
        except transient.REDIS:
            if strict:
                raise
            # Redis away: bill what Postgres knows (nothing generated is recorded there)
            log.warning("could not read %s's stream to bill it", job_id, exc_info=True)
            return []
        return [e for e in evs if isinstance(e, Delta)]

    def _end_billed(
        self, stmt: Any, params: dict[str, Any], outcome: Ending, ev: Done | Failed, u: Usage, engine_s: float
    ) -> Any:
        """`_end` for an ending whose bill is known before it (succeed, fail): the transition and the
        usage row in one statement (`usage.billed_with`), on an autocommit connection, one round trip.
        Returns the ended row (None when the transition lost: nothing billed, nothing announced)."""
        bill = usage.bill(outcome, u.prompt_tokens, u.completion_tokens, engine_s)
        found = one_statement(self.sessions, stmt, {**params, **bill})
        if not found:
            return None
        row = found[0]
        self._counted(row, outcome, u, engine_s)  # the row is in `usage_daily` already: the counters only
        self._announce(row, u.total_tokens, ev)
        return row

    def succeed(self, job: Job | Claimed, result: JobResult, u: Usage, engine_s: float) -> bool:
        stored = result.model_dump(mode="json")
        marks = self._marks(job.id)
        _, params = transitions.succeed(job.id, job.attempt, stored, u.model_dump(mode="json"), marks)
        done = Done(attempt=job.attempt, usage=u, result=inline_result(result, stored))
        row = self._end_billed(SUCCEED, params, Ending.succeeded, done, u, engine_s)
        if row is not None:
            PROMPT_TOKENS.labels(row.model).inc(u.prompt_tokens)
            GENERATION_TOKENS.labels(row.model).inc(u.completion_tokens)
            if row.finished_at is not None and row.created_at is not None:
                E2E.labels(row.model, row.kind).observe((row.finished_at - row.created_at).total_seconds())
        return row is not None

    def fail_queued(self, job_id: str, attempt: int, error: ErrorInfo) -> bool:
        """A queued job that must never start (the dispatcher's batch line over its tenant's daily
        tokens): failed like every ending (usage row, settle, terminal event). False if it was no
        longer queued."""
        # Only an earlier attempt (requeued) can have streamed: a first one never ran.
        marks = self._marks(job_id) if attempt > 1 else None
        stmt = transitions.fail_queued(job_id, attempt, error.model_dump(mode="json"), marks)
        return self._end(stmt, Ending.failed, Failed(attempt=attempt, error=error)) is not None

    def fail(self, job: Job | Claimed, error: ErrorInfo, u: Usage | None = None, engine_s: float = 0.0) -> bool:
        """`u`: what to bill; by default what the job's stream delivered (`delivered`)."""
        if u is None:
            u = self.delivered(job)
        error = _storable_error(error)
        _, params = transitions.fail(job.id, job.attempt, error.model_dump(mode="json"), self._marks(job.id))
        ev = Failed(attempt=job.attempt, error=error)
        return self._end_billed(FAIL, params, Ending.failed, ev, u, engine_s) is not None

    def cancel(self, job_id: str, tenant_id: int) -> Job | None:
        """Cancel a live job of this tenant; returns its row either way (None: not this tenant's)."""
        stmt = transitions.cancel(job_id, tenant_id, CANCELLED.model_dump(mode="json"))
        row = self._end(stmt, Ending.cancelled, Cancelled(), self._cancelled)
        if row is not None:
            return row
        with self.sessions() as s:
            return s.execute(transitions.get_for_tenant(job_id, tenant_id)).scalar()

    def reap(self) -> dict[str, int]:
        """Jobs whose worker stopped renewing its lease: back to `queued` with the next attempt (the
        next attempt resumes from the streamed tokens), or failed once attempts run out, billed what
        their streams delivered. While Redis is away the failing waits for a later pass (the bill
        needs the stream); the requeueing does not."""
        n = self.settings.max_attempts
        err = worker_lost(n)
        with self.sessions() as s:
            requeued_rows = s.execute(transitions.requeue_lapsed(n)).all()
            s.commit()
        for r in requeued_rows:
            REAPED.labels(r.model).inc()
        billed: list[tuple[Job, Usage]] = []
        with self.sessions() as s:
            failed = s.execute(transitions.fail_lapsed(n, err.model_dump(mode="json"))).scalars().all()
            try:
                billed = [(row, self.delivered(row)) for row in failed]
                for row in failed:
                    transitions.keep_marks(row, self._marks(row.id, strict=True))
            except transient.REDIS:
                log.warning("Redis away: %d lapsed jobs are failed on a later pass", len(failed))
                s.rollback()
                return {"requeued": len(requeued_rows), "failed": 0}
            for row, u in billed:
                self._record(s, row, Ending.failed, u, 0.0)
            s.commit()
        for row, u in billed:
            REAPED.labels(row.model).inc()
            self._announce(row, u.total_tokens, Failed(attempt=row.attempt, error=err))
        return {"requeued": len(requeued_rows), "failed": len(billed)}

    # -- a batch's lines that never ran --------------------------------------------------------
    def end_queued_lines(self, session: Session, batch_id: str, to: Ending, limit: int) -> list[Any]:
        """Up to `limit` of a batch's queued lines -> `to` (expired or cancelled), each counted once
        in usage (one upsert per tenant, key and model, not per line), in the caller's transaction.
        After it commits, the caller passes the rows to `announce_lines`. The lines never ran for
        their batch (a line a lost worker had started is requeued, and its output never reaches the
        batch's files): they bill nothing."""
        err = LINE_ENDINGS[to]
        rows = session.execute(
            transitions.end_queued_lines(batch_id, to.state, err.model_dump(mode="json"), limit)
        ).all()
        self._record_many(session, rows, to)
        return list(rows)

    def announce_lines(self, rows: Sequence[Any], to: Ending) -> None:
        """After `end_queued_lines` committed: each line's reservation released and its terminal
        event published, in pipelines (on a stream only where a requeued line's earlier attempt
        wrote one: a line that never ran leaves nothing in Redis)."""
        ends: list[tuple[str, int, Failed | Cancelled]] = [
            (r.id, r.tenant_id, Failed(attempt=r.attempt, error=BATCH_EXPIRED) if to == Ending.expired else Cancelled())
            for r in rows
        ]
        self._announce_many(ends)


def _storable(text: str) -> str:
    """Text Postgres can hold in JSONB: no NUL, no unpaired surrogate (an error message quoting
    something odd). Only for error messages: results keep their text exactly."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def partial_result(deltas: Sequence[Delta]) -> dict[str, Any] | None:
    """The text a job's stream carried, per choice, as a stored result without finish reasons (a
    cancelled job's); None when it carried none."""
    texts: dict[int, list[str]] = {}
    prefix: dict[int, int] = {}
    for d in deltas:
        texts.setdefault(d.choice, []).append(d.text)
        if d.prefix_len:
            prefix.setdefault(d.choice, d.prefix_len)
    if not any(any(t) for t in texts.values()):
        return None
    choices = [
        ChoiceResult(index=i, text=_storable("".join(texts[i])), prefix_len=prefix.get(i, 0)) for i in sorted(texts)
    ]
    return JobResult(choices=choices).model_dump(mode="json")


def _storable_error(error: ErrorInfo) -> ErrorInfo:
    clean = _storable(error.message)
    return error if clean == error.message else error.model_copy(update={"message": clean})
