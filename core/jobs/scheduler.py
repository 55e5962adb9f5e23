"""Weighted fair dispatch across tenants (stride scheduling), interactive before batch.

Each tick, for one model, the dispatcher asks for at most `room` jobs (what the workers can start
soon). Candidates are every tenant's best queued jobs (interactive first, then the request's
`priority`, then age). Tenants at their concurrency cap are skipped. Among the rest, interactive
heads go first; otherwise the tenant with the lowest *pass* wins and its pass grows by 1/weight,
so over time tenants get jobs in proportion to their weights whatever their backlogs.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from core.infra.orm import Job, Tenant
from core.states import JobKind, JobState

# The distinct tenants with queued jobs for a model, as a loose index scan (one index probe per
# tenant) rather than a DISTINCT over every queued row: a million-line batch stays cheap to schedule.
_TENANTS_WITH_QUEUED = text("""
WITH RECURSIVE t AS (
  (SELECT tenant_id FROM jobs WHERE model = :model AND state = 'queued' ORDER BY tenant_id LIMIT 1)
  UNION ALL
  SELECT (SELECT j.tenant_id FROM jobs j WHERE j.model = :model AND j.state = 'queued' AND j.tenant_id > t.tenant_id
          ORDER BY j.tenant_id LIMIT 1)
  FROM t WHERE t.tenant_id IS NOT NULL
)
SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL
""")


class FairScheduler:
    def __init__(self) -> None:
        self.passes: dict[int, float] = {}

    def pick(self, session: Session, model: str, room: int, batch_room: int | None = None) -> list[str]:
        """Up to `room` job ids to send now, of which at most `batch_room` batch lines (None: no limit
        beyond `room`): bulk work goes out only as engine slots free for it."""
        if room <= 0:
            return []
        batch_room = room if batch_room is None else max(0, batch_room)
        queued = Job.state == JobState.queued.value
        tenants = session.execute(
            select(Tenant.id, Tenant.weight, Tenant.max_concurrent).where(
                Tenant.id.in_(list(session.scalars(_TENANTS_WITH_QUEUED, {"model": model})))
            )
        ).all()
        if not tenants:
            return []
        busy = dict(
            session.execute(
                select(Job.tenant_id, func.count())
                .where(
                    Job.state.in_([JobState.dispatched.value, JobState.running.value]),
                    Job.tenant_id.in_([t.id for t in tenants]),
                )
                .group_by(Job.tenant_id)
            ).all()
        )
        heads: dict[int, list[tuple[str, bool]]] = defaultdict(list)
        for t in tenants:
            cap = t.max_concurrent
            take = room if cap is None else min(room, cap - busy.get(t.id, 0))
            if take <= 0:
                continue
            for kind in (JobKind.interactive, JobKind.batch):  # each an index range scan (ix_jobs_queue), no sort
                if take <= 0:
                    break
                ids = session.scalars(
                    select(Job.id)
                    .where(queued, Job.model == model, Job.tenant_id == t.id, Job.kind == kind.value)
                    .order_by(Job.priority.desc(), Job.created_at)
                    .limit(take)
                ).all()
                heads[t.id] += [(i, kind == JobKind.interactive) for i in ids]
                take -= len(ids)
        weight = {t.id: max(1, t.weight) for t in tenants}
        floor = min((self.passes[t] for t in heads if t in self.passes), default=0.0)
        for tid in heads:  # a tenant that was idle starts level with the others, not far behind
            self.passes[tid] = max(self.passes.get(tid, floor), floor)
        picks: list[str] = []
        batch_picked = 0
        while len(picks) < room and any(heads.values()):
            if batch_picked >= batch_room:  # no batch slot left: only interactive heads may go
                for q in heads.values():
                    q[:] = [h for h in q if h[1]]
                if not any(heads.values()):
                    break
            live = [t for t, q in heads.items() if q]
            urgent = [t for t in live if heads[t][0][1]]
            best = min(urgent or live, key=lambda x: (self.passes[x], x))
            job_id, interactive = heads[best].pop(0)
            picks.append(job_id)
            batch_picked += not interactive
            self.passes[best] += 1.0 / weight[best]
        return picks
