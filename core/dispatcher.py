"""The dispatcher loop: everything the happy path (core/jobs/submit.py: `Submitter` persists, then enqueues) missed.

- The dispatcher (`spool dispatcher`; running two is safe: every move is a compare-and-set) feeds
  each model's queues in weighted fair order (core/jobs/scheduler.py), never more than the workers can
  start soon; re-sends `dispatched` jobs nobody claimed (lost messages); and returns jobs whose
  worker stopped renewing its lease to `queued` with the next attempt number, or fails them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import redis
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from core import retention
from core.batches import progress as batches
from core.batches import webhooks
from core.config import Settings
from core.generation.events import ErrorInfo
from core.infra import heap, redis_keys, transient
from core.infra.broker import queued_jobs, queues_for, reclaim, send_deliver_webhook, send_routed, send_run_jobs
from core.infra.db import Listener
from core.infra.metrics import (
    AWAITING_WORKER,
    LIVE_WORKERS,
    OLDEST,
    QUEUED,
    RECLAIMED,
    STORED,
    STORED_REDIS,
    WANTED_WORKERS,
)
from core.infra.orm import Job, Tenant
from core.jobs import live_workers
from core.jobs import transitions as jobs
from core.jobs.lifecycle import Lifecycle
from core.jobs.scheduler import FairScheduler, Weights
from core.registry import settings_for
from core.states import JobKind, JobState
from core.tenancy import admission, quota

log = logging.getLogger(__name__)
STORED_GAUGES_S = 30.0  # how stale the per-tenant stored-bytes gauges may be

WAKE_COALESCE_S = 0.05


class Dispatcher:
    def __init__(self, sessions: sessionmaker, rds: redis.Redis, broker: redis.Redis, settings: Settings) -> None:
        self.sessions, self.rds, self.broker, self.settings = sessions, rds, broker, settings
        self.scheduler = FairScheduler(
            Weights(settings.fair_input_weight, settings.fair_cached_weight, settings.fair_output_weight)
        )
        self.lifecycle = Lifecycle(sessions, rds, settings)
        self._next_sweep = 0.0
        self._next_stored = 0.0  # the stored-bytes gauges: read once every STORED_GAUGES_S
        self._next_upkeep = 0.0
        self.batches_pending = False  # the last batch pass stopped at a full slice
        self.batch_rotation = batches.Rotation()  # where each tenant's last keeper pass stopped
        # Free batch slots a woken pass waits for: a message's worth, but no more than a worker
        # holds in reserve (its prefetched lines are what keeps its engine full until then).
        self.refill_at = max(1, min(settings.batch_group, settings.prefetch_for(settings.max_batch)))
        # A worker holding running jobs -> (its last heartbeat value seen, when it last moved by our clock).
        self.heard: dict[str, tuple[float | None, float]] = {}
        # Since when (our clock) this dispatcher's own writes to Redis have succeeded; None while refused.
        self.writable_since: float | None = None
        self._probe_key = redis_keys.dispatcher_probe(uuid.uuid4().hex)
        self._stored_tenants: set[int] = set()  # tenants the Redis-bytes gauge has a value for

    def tick(self, woken: bool = False) -> dict[str, int]:
        """One pass. Returns counts for logs and tests. `woken`: a pass that follows a send or a wake
        (a worker freed batch slots, a batch was queued) sends only once `refill_at` slots are free."""
        s = self.settings
        # Lapsed leases and lost messages are looked for once per interval; the ticks a freed batch
        # slot triggers in between (hundreds a second with short lines) only refill the queues.
        upkeep = time.monotonic() >= self._next_upkeep
        counts: dict[str, int] = {}
        lost: list = []
        with self.sessions() as session:
            sent = 0
            if upkeep and not woken and not session.scalar(select(jobs.any_unended())):
                # Idle: no job queued, dispatched or running, so nothing to reap, re-send or pick. One
                # probe instead of a full pass: an idle dispatcher took 5 % of a core at 2 passes a second.
                self._next_upkeep = time.monotonic() + s.dispatcher_interval_s
                self.heard.clear()
                return {"resent": 0, "sent": 0}
            if upkeep:
                self._next_upkeep = time.monotonic() + s.dispatcher_interval_s
                revoked = self._revoke_unheard(session)
                counts = self.lifecycle.reap()
                reclaimed = self._reclaim()
                if reclaimed:
                    counts["reclaimed"] = reclaimed
                if revoked:
                    counts["revoked"] = revoked
                # A job dispatched but unclaimed past the timeout: re-send it unless its message is
                # still waiting in its queue (slow, not lost). Under any backlog a lost message is found.
                stale = session.execute(
                    jobs.touch_stale_dispatched(s.dispatch_timeout_s, s.dispatcher_batch, s.model_ids)
                ).all()
                session.commit()
                waiting = set().union(*(queued_jobs(self.broker, m) for m in {row.model for row in stale}))
                lost = [row for row in stale if (row.id, row.attempt) not in waiting]
                sent = self._send(session, lost)
                cold = self._fail_cold(session)
                if cold:
                    counts["cold"] = cold

            self.scheduler.settle(session)  # ended jobs' charges corrected to what they were served
            for model in s.model_ids:
                # A woken pass (any job ended) with no request waiting for the model: one index probe.
                requests_wait = not woken or upkeep or bool(session.scalar(jobs.requests_queued(model)))
                room = min(s.queue_depth - self._depth(model), s.dispatcher_batch)
                # Batch lines (and flex requests) go out only for free batch slots of live workers:
                # never parked in a worker thread or in Redis, where they would hold up interactive work.
                live = live_workers.live(self.rds, model)
                batch_room = sum(w.batch_slots for w in live if not w.draining) - session.scalar(
                    jobs.batch_in_flight(model)
                )
                # API requests in flight are held to the workers' slots (what the API's INSERT holds them
                # to): beyond that they would wait inside a worker, in arrival order, whoever sent them.
                request_room = live_workers.slots(live) - session.scalar(select(jobs.interactive_in_flight(model)))
                if not requests_wait and batch_room < self.refill_at:
                    # A slot or two: the worker's prefetched lines fill them meanwhile. Refilling
                    # them one at a time cost a full pass per line (~6 ms of dispatcher CPU a line).
                    continue
                picks = self.scheduler.pick(session, model, room, batch_room, request_room)
                if picks:
                    picks = self._admit_lines(session, picks)
                rows = session.execute(jobs.dispatch_picked(picks)).all() if picks else []
                session.commit()
                sent += self._send(session, rows)
        counts |= {"resent": len(lost), "sent": sent}
        if any(v for k, v in counts.items() if k != "sent"):
            log.info("dispatcher: %s", counts)
        return counts

    def _fail_cold(self, session: Session) -> int:
        """Requests of a model that may have no worker (`min_workers` 0), held for one longer than its
        `cold_wait_s` while none came up: failed with 503 `model_not_loaded` (their clients were waiting
        with keep-alives). Only while the model has no live worker: once one is, they are picked."""
        ended = 0
        for model in self.settings.model_ids:
            ms = settings_for(model, self.settings)
            if ms.min_workers != 0 or live_workers.live(self.rds, model):
                continue
            for job_id, attempt in session.execute(
                jobs.held_past(model, ms.cold_wait_s, self.settings.dispatcher_batch)
            ):
                why = f"No worker came up for '{model}' within {ms.cold_wait_s:g} s; retry later."
                error = ErrorInfo(message=why, type="service_unavailable", code="model_not_loaded")
                ended += self.lifecycle.fail_queued(job_id, attempt, error)
        return ended

    def _revoke_unheard(self, session: Session) -> int:
        """A worker cut from Redis but not from Postgres keeps renewing its leases, so its jobs'
        streams stay silent for as long as the cut lasts. Redis stops receiving its heartbeats; once
        this dispatcher has seen one's heartbeat stand still for SPOOL_WORKER_UNHEARD_S, reading Redis itself all
        along, the worker's running jobs are re-queued with their next attempt in one statement:
        another worker resumes each from what its stream delivered. The cut worker finds its next
        renewal refused and stops; an append it still has in flight is refused by the stream's fence.
        A heartbeat counts as heard when its value changes, timed by this dispatcher's clock: a worker
        host whose clock runs behind is never judged for it. Redis away for this dispatcher too:
        nobody is judged (it is an outage, not a cut), and every worker's silence starts afresh.
        Likewise while Redis refuses this dispatcher's writes (OOM, MISCONF, READONLY): reads still
        work there, but every worker's heartbeat is refused too and stands still. Nobody is judged
        until writes have succeeded again for a whole SPOOL_WORKER_UNHEARD_S (`_writable`)."""
        models = self.settings.model_ids
        holders = {w for w in session.scalars(jobs.running_holders(models)) if w}
        if not holders:
            self.heard.clear()
            return 0
        writable = self._writable()
        if writable is None:
            self.heard.clear()
            return 0
        try:
            beats: dict[str, float] = {}
            for m in models:
                beats |= live_workers.beats(self.rds, m)
        except transient.REDIS:
            self.heard.clear()
            return 0
        now = time.monotonic()
        heard: dict[str, tuple[float | None, float]] = {}
        for w in holders:
            value, last = beats.get(w), self.heard.get(w)
            if last is None or (value is not None and value != last[0]):
                heard[w] = (value, now)  # first seen, or its heartbeat moved
            else:
                heard[w] = last
        self.heard = heard
        unheard_s = self.settings.worker_unheard_s
        due = sorted(w for w, (_, since) in heard.items() if now - since >= unheard_s)
        if not due or now - writable < unheard_s:
            return 0
        ended = session.execute(jobs.requeue_held_by(due, self.settings.max_attempts)).all()
        session.commit()
        for w in due:
            del self.heard[w]
        log.warning(
            "workers %s: heartbeat still for %.0f s while renewing leases in Postgres (cut from Redis?): "
            "%d running jobs go to other workers",
            due,
            unheard_s,
            len(ended),
        )
        return len(ended)

    def _writable(self) -> float | None:
        """Write a probe key of this dispatcher's own: since when (our clock) writes have succeeded
        without a break, None while Redis refuses them. Judging waits a whole `worker_unheard_s` past
        that moment: a worker's heartbeat needs that long to be seen moving again after a refusal
        ends (and this probe may succeed a moment before the workers' next beats do)."""
        try:
            self.rds.set(self._probe_key, 1, ex=max(5, int(self.settings.dispatcher_interval_s * 4)))
        except transient.REDIS:
            if self.writable_since is not None:
                log.warning("Redis refuses this dispatcher's writes: no worker is judged unheard meanwhile")
            self.writable_since = None
            return None
        if self.writable_since is None:
            self.writable_since = time.monotonic()
        return self.writable_since

    def keep_batches(self) -> dict[str, int]:
        """Batch bookkeeping (counts, expiry, cancellation, finalization), webhooks, gauges and the
        retention sweep: one pass. Runs on a thread of its own (`run_forever`), never inside `tick`:
        expiring or finalizing a huge batch must not hold up dispatch, reaping and re-sends."""
        s = self.settings
        counts: dict[str, int] = {}
        # What there is to do, in one round trip: each part below that finds nothing is skipped, so an
        # idle keeper costs a probe a pass rather than a pass of statements.
        with self.sessions() as session:
            unended, live, hooks = session.execute(
                select(jobs.any_unended(), batches.any_live(), webhooks.any_pending())
            ).one()
        done = batches.advance(self.sessions, self.lifecycle, rotation=self.batch_rotation) if live else batches.Pass()
        counts["batches_ended"] = done.ended
        self.batches_pending = done.more
        with self.sessions() as session:
            self._gauges(session, scan=bool(unended))
            if time.monotonic() >= self._next_stored:  # a few rows a tenant: not worth a probe's every pass
                self._next_stored = time.monotonic() + STORED_GAUGES_S
                self.stored_gauges(session)
        # Webhooks leave from a Celery task: a slow receiver never holds this loop up.
        due = []
        if hooks:
            with self.sessions() as session:
                due = webhooks.claim_due(session, lease_s=s.webhook_timeout_s * 3 + 30)
        for b in due:
            send_deliver_webhook(b.id, webhooks.event_body(b.status, batches.batch_json(b)))
        counts["webhooks"] = len(due)
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + 60
            counts |= {f"swept_{k}": v for k, v in retention.sweep(self.sessions, s).items()}
        if any(counts.values()):
            log.info("batch keeper: %s", counts)
        return counts

    def run_batch_keeper(self, stop: threading.Event | None = None) -> None:
        """`keep_batches` once per interval, forever (a thread of the dispatcher process), and at once
        when a batch's last line ends (the NOTIFY of migration 0011): a finished batch's output file
        is there a few milliseconds later, not up to an interval later."""
        engine = self.sessions.kw.get("bind")
        lines_ended = None
        if isinstance(engine, Engine) and engine.dialect.name == "postgresql":
            lines_ended = Listener(engine, batches.LINES_ENDED)
            lines_ended.start()
        try:
            self._keep_batches_until(stop, lines_ended)
        finally:
            if lines_ended is not None:
                lines_ended.close()

    def _keep_batches_until(self, stop: threading.Event | None, lines_ended: Listener | None) -> None:
        while stop is None or not stop.is_set():
            started = time.monotonic()
            try:
                self.keep_batches()
            except Exception as exc:
                if not transient.is_transient(exc):
                    log.exception("batch bookkeeping failed; retrying")
                else:
                    log.warning("batch bookkeeping: Postgres/Redis unavailable (%r); retrying", exc)
            if self.batches_pending:
                # A batch stopped at a full slice: go on with it soon, but rest as long as the pass
                # took, so working through a huge batch takes at most half a core from the others.
                time.sleep(max(0.05, time.monotonic() - started))
                continue
            rest = max(0.05, self.settings.dispatcher_interval_s - (time.monotonic() - started))
            if lines_ended is None:
                time.sleep(rest)
            else:
                lines_ended.wait(rest)

    def _admit_lines(self, session: Session, picks: list[str]) -> list[str]:
        """Batch lines take their tenant's limits as they dispatch (core/tenancy/admission.py): a line
        of a tenant at `max_queued` stays queued for a later tick; one over the daily token quota fails
        with an error naming it. Returns the picks that may go."""
        rows = session.execute(
            select(Job.id, Job.attempt, Job.tenant_id, Job.key_id, Job.reserved_tokens, Tenant.tpd, Tenant.max_queued)
            .join(Tenant, Tenant.id == Job.tenant_id)
            .where(Job.id.in_(picks), Job.kind == JobKind.batch.value)
        ).all()
        if not rows:
            return picks
        lines = [
            admission.Line(r.id, r.tenant_id, r.key_id or 0, r.reserved_tokens or 0, r.tpd or 0, r.max_queued or 0)
            for r in rows
        ]
        wait, over = admission.admit_lines(self.rds, lines)
        attempts = {r.id: r.attempt for r in rows}
        for job_id, message in over.items():
            err = ErrorInfo(message=message, type="tokens", code="rate_limit_exceeded")
            self.lifecycle.fail_queued(job_id, attempts[job_id], err)
        return [p for p in picks if p not in wait and p not in over]

    def _gauges(self, session: Session, scan: bool = True) -> None:
        """Queue depth, oldest queued job and live workers per model: a scan of the backlog, so once
        per interval, not per tick; none when no job is unended (`scan` false: every count is 0)."""
        seen: dict[tuple[str, str], tuple[int, Any]] = {
            (m, k): (0, None) for m in self.settings.model_ids for k in (JobKind.interactive.value, JobKind.batch.value)
        }
        rows = (
            session.execute(
                select(Job.model, Job.kind, func.count(), func.min(Job.created_at))
                .where(Job.state == JobState.queued.value)
                .group_by(Job.model, Job.kind)
            ).all()
            if scan
            else []
        )
        for model, kind, n, oldest in rows:
            seen[(model, kind)] = (n, oldest)
        now = time.time()
        for (model, kind), (n, oldest) in seen.items():
            QUEUED.labels(model, kind).set(n)
            OLDEST.labels(model, kind).set(now - oldest.timestamp() if oldest is not None else 0)
        for model in self.settings.model_ids:
            live = len(live_workers.live(self.rds, model))
            LIVE_WORKERS.labels(model).set(live)
            waiting = seen[(model, JobKind.interactive.value)][0]
            queued = waiting + seen[(model, JobKind.batch.value)][0]
            WANTED_WORKERS.labels(model).set(max(settings_for(model, self.settings).min_workers, 1 if queued else 0))
            AWAITING_WORKER.labels(model).set(0 if live else waiting)

    def stored_gauges(self, session: Session) -> None:
        """Each tenant's bytes per store: a few rows per tenant (core/tenancy/quota.py), never a scan of jobs."""
        held = quota.all_stored(session, self.rds, self.settings.ended_events_ttl_s)
        for tenant in self._stored_tenants - held.keys():  # it stores nothing any more
            STORED_REDIS.labels(str(tenant)).set(0)
            for store in quota.STORES:
                STORED.labels(str(tenant), store).set(0)
        for tenant, counts in held.items():
            for store, nbytes in counts.items():
                if nbytes is not None:  # None: Redis did not answer, the last value stays
                    STORED.labels(str(tenant), store).set(nbytes)
            if counts["redis"] is not None:
                STORED_REDIS.labels(str(tenant)).set(counts["redis"])
        self._stored_tenants = set(held)

    def _depth(self, model: str) -> int:
        return sum(self.broker.llen(q) for q in queues_for(model))

    def _fleets(self, models: set[str]) -> dict[str, list[tuple[str, int]]]:
        """Each model's live workers (name, slots), where prefix affinity may send its requests."""
        if not self.settings.affinity:
            return {}
        return {m: live_workers.fleet(live_workers.live(self.rds, m)) for m in models}

    def _send(self, session: Session, rows: list) -> int:
        """One message per interactive job, to the worker its affinity key picks when the model has
        several (core/infra/broker.py `route`); batch lines of a model `batch_group` to a message (one
        Celery round trip and one claim for all of them)."""
        messages: list[tuple[str, str, list[tuple[str, int]]]] = []
        batch: dict[str, list[tuple[str, int]]] = {}
        requests: list[tuple[str, int, str, str, int | None]] = []
        for job_id, attempt, model, kind, key in rows:
            if kind == JobKind.batch:
                batch.setdefault(model, []).append((job_id, attempt))
            else:
                requests.append((job_id, attempt, model, kind, key))
        n = self.settings.batch_group
        for model, pairs in batch.items():
            messages += [(model, JobKind.batch, pairs[i : i + n]) for i in range(0, len(pairs), n)]
        sent = 0
        if requests:
            try:
                fleets = self._fleets({r[2] for r in requests})
                s = self.settings
                send_routed(self.broker, requests, fleets, s.affinity_spill_load, s.affinity_key_rate)
                sent += len(requests)
            except Exception:
                log.warning("send failed for %d requests; back to queued", len(requests), exc_info=True)
                for job_id, attempt, *_ in requests:
                    session.execute(jobs.undispatch(job_id, attempt))
                session.commit()
        for model, _, pairs in messages:
            try:
                send_run_jobs(pairs, model)
                sent += len(pairs)
            except Exception:
                log.warning("send failed for %d jobs; back to queued", len(pairs), exc_info=True)
                for job_id, attempt in pairs:
                    session.execute(jobs.undispatch(job_id, attempt))
                session.commit()
        return sent

    def _reclaim(self) -> int:
        """Messages waiting in the own queue of a worker that is gone (dead, drained, cut from Redis:
        its heartbeat older than live_workers.LIVE_S) moved to its model's shared queue for the others."""
        moved = 0
        for model in self.settings.model_ids:
            live = {name for name, _ in live_workers.fleet(live_workers.live(self.rds, model))}
            n = reclaim(self.broker, model, live)
            if n:
                RECLAIMED.labels(model).inc(n)
                log.warning("%d messages of gone workers of %s moved to the shared queue", n, model)
            moved += n
        return moved

    def run_forever(self) -> None:
        log.info("dispatcher started (every %.1fs)", self.settings.dispatcher_interval_s)
        threading.Thread(target=self.run_batch_keeper, name="batch-keeper", daemon=True).start()
        heap.freeze_startup()
        woke: Any = None
        sent = 0
        while True:
            started = time.monotonic()
            # A pass right after a send or a wake refills batch slots only once enough are free;
            # one after a quiet interval (and every upkeep pass) fills whatever is free.
            eager = bool(sent) or woke is not None
            sent = 0
            try:
                sent = self.tick(woken=eager).get("sent", 0)
            except Exception as exc:  # Postgres/Redis unavailable: the next tick tries again, nothing fails
                if not transient.is_transient(exc):
                    log.exception("dispatcher tick failed; retrying")
                else:
                    log.warning("dispatcher tick: Postgres/Redis unavailable (%r); retrying", exc)
            # While it has work to hand out, refill the queues as soon as workers drain them: a
            # fixed period would cap short batch lines at queue_depth per period.
            pause = 0.02 if sent else self.settings.dispatcher_interval_s - (time.monotonic() - started)
            if pause > 0.05:
                # A worker that frees a batch slot wakes us (live_workers.wake_dispatcher): refill at once.
                try:
                    woke = self.rds.blpop([redis_keys.DISPATCHER_WAKE], timeout=pause)
                    self.rds.delete(redis_keys.DISPATCHER_WAKE)
                except Exception:
                    woke = None
                    time.sleep(pause)
                if woke is not None:
                    # Lines of one batch end together (a step ends many): let the rest of them free
                    # their slots too, and refill them in one tick rather than one tick per line. A
                    # worker's prefetched lines keep its engine busy meanwhile (`batch_prefetch`).
                    time.sleep(WAKE_COALESCE_S)
            else:
                time.sleep(max(0.0, pause))
