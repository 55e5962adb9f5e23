"""What the status page shows, read from the ledger and the workers' heartbeats: models with live
workers and queue depth, running jobs, batches with progress and ETA, per-tenant usage per hour
over the last 24 hours. Read-only; every query is bounded."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, func, select
from sqlalchemy.orm import Session, sessionmaker

from core.batches.progress import counts as batch_counts
from core.infra.orm import Batch, Job, Tenant
from core.jobs import live_workers
from core.states import FINAL, JobState


@dataclass
class ModelRow:
    id: str
    live_workers: int
    queued_interactive: int = 0
    queued_batch: int = 0
    running: int = 0
    oldest_queued_s: float | None = None
    start_failure: str | None = None  # the latest worker start failure (model load, warm-up), its words


@dataclass
class BatchRow:
    id: str
    tenant: str
    status: str
    total: int
    completed: int
    failed: int
    created_at: datetime
    eta_s: float | None

    @property
    def done_fraction(self) -> float:
        return (self.completed + self.failed) / self.total if self.total else 0.0


@dataclass
class Snapshot:
    at: datetime
    models: list[ModelRow]
    running: list[dict[str, Any]]
    batches: list[BatchRow]
    usage: dict[str, list[int]] = field(default_factory=dict)  # tenant -> tokens per hour, oldest first
    hours: list[datetime] = field(default_factory=list)


def snapshot(sessions: sessionmaker[Session], rds: Any, model_ids: list[str], now: datetime | None = None) -> Snapshot:
    """What the status page shows, read in one short session of `sessions` (synchronous: run it
    in a thread)."""
    with sessions() as session:
        return _read(session, rds, model_ids, now or datetime.now(UTC))


def _read(session: Session, rds: Any, model_ids: list[str], now: datetime) -> Snapshot:
    models = {m: ModelRow(m, len(live_workers.live(rds, m))) for m in model_ids}
    for m, model_row in models.items():
        failed = live_workers.failures(rds, m)
        model_row.start_failure = f"{failed[0].name}: {failed[0].error}" if failed else None
    for model, kind, state, n, oldest in session.execute(
        select(Job.model, Job.kind, Job.state, func.count(), func.min(Job.created_at))
        .where(Job.state.in_([JobState.queued.value, JobState.dispatched.value, JobState.running.value]))
        .group_by(Job.model, Job.kind, Job.state)
    ).all():
        row = models.get(model)
        if row is None:
            continue
        if state == JobState.running.value:
            row.running += n
        elif kind == "batch":
            row.queued_batch += n
        else:
            row.queued_interactive += n
        if state == JobState.queued.value and oldest is not None:
            age = (now - oldest).total_seconds()
            row.oldest_queued_s = max(row.oldest_queued_s or 0.0, age)

    running = [
        {"id": j.id, "tenant": t, "model": j.model, "kind": j.kind, "attempt": j.attempt, "started_at": j.started_at}
        for j, t in session.execute(
            select(Job, Tenant.name)
            .join(Tenant, Tenant.id == Job.tenant_id)
            .where(Job.state == JobState.running.value)
            .order_by(Job.started_at)
            .limit(25)
        ).all()
    ]

    batches: list[BatchRow] = []
    recent = now - timedelta(hours=24)
    for b, tenant in session.execute(
        select(Batch, Tenant.name)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where((Batch.status.notin_([s.value for s in FINAL])) | (Batch.created_at > recent))
        .order_by(Batch.created_at.desc())
        .limit(20)
    ).all():
        counts = batch_counts(b)
        total = counts["total"]
        done = counts["completed"] + counts["failed"]
        eta = None
        if b.in_progress_at is not None and 0 < done < total:
            rate = done / max((now - b.in_progress_at).total_seconds(), 1e-3)
            eta = (total - done) / rate
        batches.append(
            BatchRow(b.id, tenant, b.status, total, counts["completed"], counts["failed"], b.created_at, eta)
        )

    start = (now - timedelta(hours=23)).replace(minute=0, second=0, microsecond=0)
    hours = [start + timedelta(hours=i) for i in range(24)]
    usage: dict[str, list[int]] = {}
    hour = func.date_trunc("hour", Job.finished_at)
    tokens = func.coalesce(Job.usage["prompt_tokens"].astext.cast(Integer), 0) + func.coalesce(
        Job.usage["completion_tokens"].astext.cast(Integer), 0
    )
    for tenant, h, n in session.execute(
        select(Tenant.name, hour, func.sum(tokens))
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.finished_at >= start, Job.usage.isnot(None))
        .group_by(Tenant.name, hour)
    ).all():
        i = int((h - start).total_seconds() // 3600)
        if 0 <= i < 24:
            usage.setdefault(tenant, [0] * 24)[i] += int(n or 0)
    return Snapshot(now, list(models.values()), running, batches, usage, hours)
