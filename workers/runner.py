"""Runs job attempts on the engine loop: claim, run one attempt (workers/attempt.py), and end the
job as failed when the attempt could not succeed; its outcome is typed (workers/outcome.py).

The Celery task is a thin entrypoint over `JobRunner.run`. Every state change goes through
core/jobs (transitions, and the lifecycle that ends jobs); the worker produces engine-neutral events
and results only (core/generation/events.py): core/protocol renders them for clients.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from sqlalchemy.orm import sessionmaker

from core.config import Settings
from core.generation.events import ErrorInfo
from core.infra import logs, streams
from core.infra.autocommit import one_statement
from core.jobs import transitions
from core.jobs.lifecycle import Lifecycle
from core.jobs.states import JobKind
from core.jobs.transitions import Claimed
from workers.attempt import Attempt
from workers.cancels import CancelWatch
from workers.engine.loop import EngineLoop
from workers.outcome import EngineError, JobError, Outcome
from workers.pump import StreamPump
from workers.retry import LETTING_GO, Abandoned, retrying

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(
        self, loop: EngineLoop, settings: Settings, redis_client: redis.Redis, sessions: sessionmaker, worker_name: str
    ) -> None:
        self.loop = loop
        self.settings = settings
        self.redis = redis_client
        self.sessions = sessions
        self.worker_name = worker_name
        self.lifecycle = Lifecycle(sessions, redis_client, settings)
        # One Redis round trip per decode step for all this worker's sequences, not one per sequence.
        self.lifecycle.appender = streams.GroupAppender(redis_client)
        # Every attempt's engine events become stream entries on one thread (workers/pump.py).
        self.pump = StreamPump(redis_client, settings)
        # Every running job's cancel key asked in one round trip, not one EXISTS per job per 0.5 s.
        self.cancels = CancelWatch(redis_client)
        self.batch_slot_wake: Any = None  # set by the worker process: called when an attempt ends

    # -- entrypoint -------------------------------------------------------------------------
    def run(self, job_id: str, attempt: int) -> Outcome:
        try:
            job = retrying(self.settings, f"claim {job_id}", self._claim, job_id, attempt)
        except Abandoned:
            log.warning("job %s attempt %s: could not claim; the dispatcher re-sends it", job_id, attempt)
            return Outcome.abandoned
        if job is None:
            log.info("job %s attempt %s: not claimable (duplicate or stale message); skipped", job_id, attempt)
            return Outcome.skipped
        return self._run_claimed(job)

    def run_group(self, pairs: list[tuple[str, int]]) -> list[Outcome]:
        """Several jobs from one message (batch lines from the dispatcher, a burst of new requests from
        the API): claimed in one statement, then run side by side, each an ordinary attempt (its own
        lease, fence, events and settlement)."""
        try:
            jobs = retrying(self.settings, f"claim {len(pairs)} jobs", self._claim_many, pairs)
        except Abandoned:
            log.warning("could not claim %d jobs; the dispatcher re-sends them", len(pairs))
            return [Outcome.abandoned] * len(pairs)
        if len(jobs) < len(pairs):
            skipped = len(pairs) - len(jobs)
            log.info("%d of %d jobs not claimable (duplicate or stale message); skipped", skipped, len(pairs))
        if len(jobs) <= 1:
            return [self._run_claimed(j) for j in jobs]
        # This thread fences the whole group in one script call and starts its attempts (their
        # sequences go to the engine) before any follows on a thread of its own. Eight threads each
        # fencing and building side by side took turns at the GIL: in a burst of 64, ~11 ms of wall
        # time from a job's claim to its sequences in the engine, for ~1 ms of CPU.
        try:
            retrying(
                self.settings,
                f"fence {len(jobs)} jobs",
                streams.raise_fences,
                self.redis,
                [(j.id, j.attempt) for j in jobs],
                self.settings.events_ttl_s,
            )
        except Abandoned:
            log.warning("could not fence %d claimed jobs; their leases lapse and they resume", len(jobs))
            return [Outcome.abandoned] * len(jobs)
        started: list[Attempt | None] = []
        for job in jobs:
            try:
                attempt: Attempt | None = Attempt(self, job, fenced=True)
            except Exception:  # a stored row it cannot read: its own thread meets it again, and fails it
                attempt = None
            if attempt is not None:
                with self._bound(job):
                    log.info("job %s attempt %s started", job.id, job.attempt)
                    # What can take long (a grammar to compile, a resumed stream to read) starts on
                    # its own thread (`run` starts it), so one tenant's job never holds the others'.
                    if not attempt.p.grammar and job.attempt == 1:
                        attempt.start()
            started.append(attempt)
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="group") as pool:
            return list(pool.map(self._run_claimed, jobs, started))

    def _claim_many(self, pairs: list[tuple[str, int]]) -> list[Claimed]:
        stmt = transitions.claim_many(pairs, self.worker_name, self.settings.lease_s)
        return transitions.claimed(one_statement(self.sessions, *stmt))

    def _claim(self, job_id: str, attempt: int) -> Claimed | None:
        stmt = transitions.claim(job_id, attempt, self.worker_name, self.settings.lease_s)
        found = transitions.claimed(one_statement(self.sessions, *stmt))
        return found[0] if found else None

    @staticmethod
    def _bound(job: Claimed) -> Any:
        return logs.bound(
            request_id=job.request_id, job_id=job.id, tenant_id=job.tenant_id, model=job.model, attempt=job.attempt
        )

    def _run_claimed(self, job: Claimed, started: Attempt | None = None) -> Outcome:
        """Run one claimed job's attempt to its outcome; `started`: already started (run_group)."""
        try:
            with self._bound(job):
                if started is None:
                    log.info("job %s attempt %s started", job.id, job.attempt)
                return self._attempt(job, started)
        finally:
            # A batch line's end frees a slot the dispatcher fills at once. Interactive jobs do not
            # wake it: that made it run a full tick per request (a third of a core at 60 requests/s).
            if job.kind == JobKind.batch and self.batch_slot_wake is not None:
                self.batch_slot_wake()

    def _attempt(self, job: Claimed, started: Attempt | None = None) -> Outcome:
        job_id, attempt = job.id, job.attempt
        try:
            return (started or Attempt(self, job)).run()
        except streams.Fenced:
            log.info("job %s attempt %s was superseded by a newer attempt; stopping", job_id, attempt)
            return Outcome.lost
        except LETTING_GO as exc:
            log.warning("job %s attempt %s let go (%s): its lease lapses and it resumes", job_id, attempt, exc)
            return Outcome.abandoned
        except JobError as exc:
            error = exc.error
        except EngineError as exc:
            log.warning("job %s: the engine failed it: %s", job_id, exc)
            error = ErrorInfo(message=f"Generation failed: {exc}", type="server_error", code="engine_error")
        except Exception:
            log.exception("job %s failed", job_id)
            error = ErrorInfo(message="Generation failed.", type="server_error", code="engine_error")
        try:
            retrying(self.settings, f"fail {job_id}", self.lifecycle.fail, job, error)
        except Abandoned:
            return Outcome.abandoned
        return Outcome.failed

    def renew(self, job: Claimed) -> bool:
        stmt = transitions.renew_lease(job.id, job.attempt, self.settings.lease_s)
        return bool(one_statement(self.sessions, stmt))
