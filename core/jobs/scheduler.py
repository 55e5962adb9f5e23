"""Token-weighted fair dispatch across tenants (a Virtual Token Counter), lane by lane.

Each tick, for one model, the dispatcher asks for at most `room` jobs (what the workers can start soon),
of which at most `batch_room` from the lane batch lines share. Lanes (core/jobs/tiers.py) go in order:
`priority` requests, then `default` ones, then `flex` requests and batch lines; a lane's jobs go only
while no lane above it has one queued. Inside a lane the tenant with the lowest counter goes next, and
its counter grows by the job's charge over the tenant's `weight`:

    charge = prompt tokens x w_in + cached prompt tokens x w_cached + output tokens x w_out

(SPOOL_FAIR_INPUT_WEIGHT, SPOOL_FAIR_CACHED_WEIGHT, SPOOL_FAIR_OUTPUT_WEIGHT: 1, 0.1, 2). At dispatch
the charge is estimated from the job's admission reservation (its prompt tokens exactly, and
`max_tokens` x candidates of output: an upper bound, all prompt tokens taken as uncached); when the job
ends it is settled to what the job was served (its usage: a prefix-cache hit is charged a tenth, a job
that failed or was cancelled before any token nothing). So tenants share a lane by tokens, not by
jobs: a tenant of 2,000-token prompts gets a thirtieth of the jobs of one of 50-token prompts.

A tenant not backlogged in the lane at the previous pick (new, idle, or held at its concurrency cap)
returns at the lowest counter of those that were, never below: idle time banks no credit, so a
returning tenant gets no burst. When nobody was backlogged, the returning tenants start level.
Counters live in this process; a restarted dispatcher starts everyone level.

The bound (docs/reliability.md, measured by `python -m ops.bench.fairness`): between two tenants
backlogged in the same lane, the difference in dispatched charge over weight stays within the largest
single job's charge over weight (the chosen tenant is always the lowest); settling can move a counter
down by at most its job's estimate, so the served difference stays within twice that, plus what is in
flight.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import any_, bindparam, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session
from sqlalchemy.types import BigInteger, Integer, String

from core.infra.orm import Job, Tenant
from core.jobs.tiers import BATCH_LANE, LANES, Tier
from core.states import TERMINAL_STATES, JobKind, JobState

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


def _heads_sql(where: str) -> Any:
    """Each tenant's best `take` queued jobs of one kind of head, in one statement (a LATERAL index
    range scan per tenant, no sort), with what the charge is estimated from. The kind and tier are
    literals, not parameters, so the planner sees the partial index's predicate (`ix_jobs_queued_tier`)."""
    return text(f"""
SELECT t.tid AS tenant_id, h.id, h.reserved_tokens, h.max_tokens, h.candidates, h.prompts
FROM unnest(:tids, :takes) AS t(tid, take)
CROSS JOIN LATERAL (
  SELECT j.id, j.reserved_tokens, (j.params->>'max_tokens')::int AS max_tokens,
         GREATEST(COALESCE((j.params->>'n')::int, 1), COALESCE((j.params->>'best_of')::int, 1)) AS candidates,
         jsonb_array_length(j.prompts) AS prompts
  FROM jobs j
  WHERE j.model = :model AND j.state = 'queued' AND j.tenant_id = t.tid AND {where}
  ORDER BY j.priority DESC, j.created_at
  LIMIT t.take
) h
""").bindparams(
        bindparam("tids", type_=ARRAY(BigInteger)), bindparam("takes", type_=ARRAY(Integer)), bindparam("model")
    )


def _tier(tier: Tier) -> Any:
    return _heads_sql(f"j.kind = 'interactive' AND j.service_tier = '{tier.value}'")


# Per lane, the kinds of heads it takes, in the order a tenant's own heads go (a flex request, whose
# client waits, before its batch lines).
_HEADS: dict[int, list[Any]] = {
    0: [_tier(Tier.priority)],
    1: [_tier(Tier.default)],
    BATCH_LANE: [_tier(Tier.flex), _heads_sql(f"j.kind = '{JobKind.batch.value}'")],
}

_ENDED = [s.value for s in TERMINAL_STATES]
SETTLE_EVERY_S = 0.5  # settle ended jobs' charges at most this often (one primary-key read of those in flight)
FORGET_AFTER_S = 6 * 3600.0  # a charge whose job never shows an end (its row deleted) is dropped


@dataclass(frozen=True)
class Weights:
    """What one token costs in the counters (the settings `fair_input_weight`, `fair_cached_weight`,
    `fair_output_weight`)."""

    input: float = 1.0
    cached: float = 0.1
    output: float = 2.0

    def estimate(self, reserved: int, max_tokens: int | None, candidates: int, prompts: int) -> float:
        """A queued job's charge before it runs: its reservation split into prompt and output tokens."""
        out = reserved if max_tokens is None else min(reserved, max_tokens * max(1, candidates) * max(1, prompts))
        return (reserved - out) * self.input + out * self.output

    def served(self, usage: dict[str, Any] | None) -> float:
        """An ended job's charge: what it was served."""
        u = usage or {}
        prompt, cached = int(u.get("prompt_tokens") or 0), int(u.get("cached_tokens") or 0)
        cached = min(cached, prompt)
        output = int(u.get("completion_tokens") or 0)
        return (prompt - cached) * self.input + cached * self.cached + output * self.output


@dataclass
class _Charge:
    lane: int
    tenant: int
    weight: int
    estimate: float
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Head:
    job_id: str
    lane: int
    charge: float


class FairScheduler:
    def __init__(self, weights: Weights | None = None) -> None:
        self.weights = weights or Weights()
        self.counters: dict[tuple[int, int], float] = {}  # (lane, tenant) -> charged tokens / weight
        self.active: dict[int, set[int]] = {lane: set() for lane in LANES}  # backlogged at the last pick
        self.charged: dict[str, _Charge] = {}  # dispatched jobs whose charge is not settled yet
        self._next_settle = 0.0

    def pick(
        self, session: Session, model: str, room: int, batch_room: int | None = None, request_room: int | None = None
    ) -> list[str]:
        """Up to `room` job ids to send now, of which at most `batch_room` from the batch lane and at most
        `request_room` from the request lanes (None: no limit beyond `room`): work goes out only as
        engine slots free for it, so the backlog, and the choice, stay here."""
        if room <= 0:
            return []
        batch_room = room if batch_room is None else max(0, batch_room)
        request_room = room if request_room is None else max(0, request_room)
        tenants = session.execute(
            select(Tenant.id, Tenant.weight, Tenant.max_concurrent).where(
                Tenant.id.in_(list(session.scalars(_TENANTS_WITH_QUEUED, {"model": model})))
            )
        ).all()
        if not tenants:
            for lane in LANES:
                self.active[lane] = set()
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
        weight = {t.id: max(1, t.weight) for t in tenants}
        take = {
            t.id: room if t.max_concurrent is None else min(room, t.max_concurrent - busy.get(t.id, 0)) for t in tenants
        }
        heads = self._heads(session, model, take, room, batch_room)
        picks: list[str] = []
        batch_picked = requests_picked = 0
        for lane in LANES:
            queues = heads[lane]
            self._lift(lane, queues)
            lane_room = batch_room - batch_picked if lane == BATCH_LANE else request_room - requests_picked
            while len(picks) < room and lane_room > 0:
                # A tenant's concurrency cap counts across lanes: `take` is what it may still start.
                ready = [t for t, q in queues.items() if q and take[t] > 0]
                if not ready:
                    break
                best = min(ready, key=lambda t: (self.counters[(lane, t)], t))
                head = queues[best].pop(0)
                take[best] -= 1
                charge = 0.0  # sent before and returned to the queue (its worker died): charged once
                if head.job_id not in self.charged:
                    charge = head.charge
                    self.charged[head.job_id] = _Charge(lane, best, weight[best], charge)
                self.counters[(lane, best)] += charge / weight[best]
                picks.append(head.job_id)
                lane_room -= 1
                if lane == BATCH_LANE:
                    batch_picked += 1
                else:
                    requests_picked += 1
        return picks

    def _heads(
        self, session: Session, model: str, take: dict[int, int], room: int, batch_room: int
    ) -> dict[int, dict[int, list[_Head]]]:
        """Every lane's queued heads per tenant (each tenant's best `take`), estimated."""
        out: dict[int, dict[int, list[_Head]]] = {lane: defaultdict(list) for lane in LANES}
        tids = [t for t, n in take.items() if n > 0]
        if not tids:
            return out
        w = self.weights
        for lane in LANES:
            if lane == BATCH_LANE and batch_room <= 0:
                continue
            for stmt in _HEADS[lane]:
                rows = session.execute(stmt, {"tids": tids, "takes": [take[t] for t in tids], "model": model})
                for r in rows:
                    out[lane][r.tenant_id].append(
                        _Head(r.id, lane, w.estimate(r.reserved_tokens or 0, r.max_tokens, r.candidates, r.prompts))
                    )
        return out

    def _lift(self, lane: int, queues: dict[int, list[_Head]]) -> None:
        """A tenant that was not backlogged here at the last pick returns at the lowest counter of those
        that were (never below its own); if none were, the returning tenants start level."""
        backlogged = {t for t, q in queues.items() if q}
        stayed = backlogged & self.active[lane]
        if stayed:
            floor = min(self.counters[(lane, t)] for t in stayed)
        else:
            floor = max((self.counters.get((lane, t), 0.0) for t in backlogged), default=0.0)
        for t in backlogged - stayed:
            self.counters[(lane, t)] = max(self.counters.get((lane, t), floor), floor)
        self.active[lane] = backlogged

    def settle(self, session: Session, force: bool = False) -> int:
        """Correct the estimates of ended jobs to what they were served; returns how many settled. At most
        once per SETTLE_EVERY_S unless `force`."""
        now = time.monotonic()
        if not self.charged or (not force and now < self._next_settle):
            return 0
        self._next_settle = now + SETTLE_EVERY_S
        ended = session.execute(
            select(Job.id, Job.usage).where(
                Job.id == any_(bindparam("ids", type_=ARRAY(String))), Job.state.in_(_ENDED)
            ),
            {"ids": list(self.charged)},
        ).all()
        for job_id, usage in ended:
            c = self.charged.pop(job_id)
            key = (c.lane, c.tenant)
            self.counters[key] = self.counters.get(key, 0.0) + (self.weights.served(usage) - c.estimate) / c.weight
        for job_id in [j for j, c in self.charged.items() if now - c.at > FORGET_AFTER_S]:
            del self.charged[job_id]
        return len(ended)

    def shares(self) -> dict[tuple[int, int], float]:
        """The counters (lane, tenant) -> charged tokens over weight, for the bench and tests."""
        return dict(self.counters)
