"""A job's start, written once: persist, then enqueue (`Submitter`, the API's `Completions` and
`Responses` submit through it). How a job ends is core/jobs/lifecycle.py's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core import idempotency
from core.idempotency import Claim
from core.infra import transient
from core.infra.autocommit import one_statement_async
from core.infra.broker import Fleet, Outbound
from core.infra.orm import Job
from core.jobs import transitions
from core.states import JobKind, JobState

log = logging.getLogger(__name__)

# Hands jobs to Celery (core/infra/broker.AsyncSender), each as (job id, attempt, model, kind, affinity
# key), with each model's live workers (name, slots) for prefix affinity, in a round trip or two.
Send = Callable[[Sequence[Outbound], Mapping[str, Fleet]], Awaitable[None]]
# Wakes the dispatcher (core/jobs/live_workers.wake_dispatcher's pipeline, on the API's client): a job
# stored `queued` is picked within milliseconds rather than at its next tick.
Wake = Callable[[], Awaitable[None]]
# At most this many new jobs in one INSERT (a burst's worth; the rest go in the next one).
GROUP_MAX = 128


class Submitter:
    """Persist, then enqueue, new jobs: commit each (and the Idempotency-Key that names it), already
    `dispatched` if its tenant has room; then hand it to Celery with `send`. The row exists before any
    message can name it; if the send fails the job goes back to `queued` and the dispatcher sends it.

    Group commit: jobs without a key that arrive while an INSERT is in flight wait for it and go
    together in the next one, a single statement, and their messages in one pipeline. A lone request
    waits for nothing; a burst of 64 costs a handful of round trips instead of 64 INSERTs and 64
    pushes. Each job still learns its own outcome: a group that fails for one row's sake (not a
    connection error) is retried row by row, so one bad row fails only its own request."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        send: Send,
        capacity: Callable[[str], int] = lambda _model: 8,
        wake: Wake | None = None,
        fleet: Callable[[str], Fleet] = lambda _model: (),
    ) -> None:
        # `capacity`: how many of a model's requests may be in flight before new ones wait for the fair
        # dispatcher (its live workers' slots and the queue depth: `Completions.capacity`).
        self.sessions, self.send, self.capacity, self.wake = sessions, send, capacity, wake
        self.fleet = fleet  # a model's live workers, as last seen: where affinity may send a request
        self._pending: list[tuple[Job, int | None, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(self, job: Job, cap: int | None = None, claim: Claim | None = None) -> None:
        if claim is not None or job.kind != JobKind.interactive:
            await self._one(job, cap, claim)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((job, cap, fut))
        if self._flusher is None:
            # A task of its own: a request cancelled while it waits must not cancel the others' INSERT.
            self._flusher = asyncio.create_task(self._flush())
        await asyncio.shield(fut)

    async def _one(self, job: Job, cap: int | None, claim: Claim | None) -> None:
        """A job with an Idempotency-Key (its key row in the same transaction), or a batch line."""
        stmt = transitions.insert_new(
            job, cap, dispatch=job.kind == JobKind.interactive, capacity=self.capacity(job.model)
        )
        if claim is None:
            (row,) = await one_statement_async(self.sessions, *stmt)
        else:
            async with self.sessions() as session:
                row = (await session.execute(*stmt)).one()
                await idempotency.record(claim, job.id, session)
                await session.commit()
        _stored(job, row)
        await self._send([job])

    async def _flush(self) -> None:
        group: list[tuple[Job, int | None, asyncio.Future[None]]] = []
        try:
            while self._pending:
                group, self._pending = self._pending[:GROUP_MAX], self._pending[GROUP_MAX:]
                try:
                    await self._store(group)
                except Exception as exc:  # a fault of ours: the group's requests fail, none waits forever
                    log.exception("storing %d new jobs failed", len(group))
                    _settle(group, exc)
        finally:
            self._flusher = None
            for *_, fut in group + self._pending:  # cancelled (the loop is shutting down): nobody waits on
                fut.cancel()  # a no-op for those already answered
            self._pending = []

    async def _store(self, group: list[tuple[Job, int | None, asyncio.Future[None]]]) -> None:
        try:
            rows = await one_statement_async(
                self.sessions,
                transitions.INSERT,
                transitions.insert_group([(job, cap) for job, cap, _ in group], self.capacity),
            )
        except Exception as exc:
            # Postgres away fails every row alike: not retried row by row.
            if len(group) > 1 and not isinstance(exc, transient.DATABASE):
                for item in group:  # one row's fault (a value Postgres refuses): only its request fails
                    await self._store([item])
                return
            _settle(group, exc)
            return
        by_id = {row.id: row for row in rows}  # RETURNING's order is not promised for a multi-row INSERT
        for job, _, _ in group:
            _stored(job, by_id[job.id])
        await self._send([job for job, _, _ in group])  # never raises: a failed send leaves the jobs queued
        _settle(group, None)

    async def _send(self, jobs: list[Job]) -> None:
        out = [j for j in jobs if j.state == JobState.dispatched.value]  # the rest: the dispatcher sends them
        if len(out) < len(jobs) and self.wake is not None:
            try:
                await self.wake()
            except Exception:  # Redis away: the dispatcher's next tick (a second) picks them up
                log.warning("could not wake the dispatcher", exc_info=True)
        if not out:
            return
        try:
            fleets = {m: self.fleet(m) for m in {j.model for j in out}}
            await self.send([(j.id, j.attempt, j.model, j.kind, j.affinity) for j in out], fleets)
        except Exception:
            log.warning("could not send %d jobs; leaving them to the dispatcher", len(out), exc_info=True)
            for j in out:
                try:
                    await one_statement_async(self.sessions, transitions.undispatch(j.id, j.attempt))
                except Exception:  # left `dispatched`: the dispatcher re-sends it after its timeout
                    log.warning("could not return job %s to queued", j.id, exc_info=True)


def _settle(group: list[tuple[Job, int | None, asyncio.Future[None]]], exc: Exception | None) -> None:
    for *_, fut in group:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


def _stored(job: Job, row: Any) -> None:
    job.state, job.created_at, job.dispatched_at = row.state, row.created_at, row.dispatched_at
