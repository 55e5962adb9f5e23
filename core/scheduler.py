"""Weighted fair dispatch across tenants (stride scheduling), interactive before batch.

Each tick, for one model, the dispatcher asks for at most `room` jobs (what the workers can start
soon). Candidates are every tenant's best queued jobs (interactive first, then the request's
`priority`, then age). Tenants at their concurrency cap are skipped. Among the rest, interactive
heads go first; otherwise the tenant with the lowest *pass* wins and its pass grows by 1/weight,
so over time tenants get jobs in proportion to their weights whatever their backlogs.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.models import Job, JobState, Tenant


class FairScheduler:
    def __init__(self) -> None:
        self.passes: dict[int, float] = {}

    def pick(self, session: Session, model: str, room: int) -> list[str]:
        if room <= 0:
            return []
        queued = Job.state == JobState.queued.value
        tenants = session.execute(
            select(Tenant.id, Tenant.weight, Tenant.max_concurrent).where(
                Tenant.id.in_(select(Job.tenant_id).where(queued, Job.model == model).distinct())
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
            rows = session.execute(
                select(Job.id, Job.kind)
                .where(queued, Job.model == model, Job.tenant_id == t.id)
                .order_by((Job.kind == "interactive").desc(), Job.priority.desc(), Job.created_at)
                .limit(take)
            ).all()
            heads[t.id] = [(r.id, r.kind == "interactive") for r in rows]
        weight = {t.id: max(1, t.weight) for t in tenants}
        floor = min((self.passes[t] for t in heads if t in self.passes), default=0.0)
        for t in heads:  # a tenant that was idle starts level with the others, not far behind
            self.passes[t] = max(self.passes.get(t, floor), floor)
        picks: list[str] = []
        while len(picks) < room and any(heads.values()):
            live = [t for t, q in heads.items() if q]
            urgent = [t for t in live if heads[t][0][1]]
            t = min(urgent or live, key=lambda x: (self.passes[x], x))
            picks.append(heads[t].pop(0)[0])
            self.passes[t] += 1.0 / weight[t]
        return picks
