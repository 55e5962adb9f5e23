"""OpenAI's service tiers, and the lane each gives a job in the fair dispatcher (core/jobs/scheduler.py).

- `priority` (and the SDK's other names for a paid fast tier: `scale`, `fast`, `ultrafast`): lane 0,
  ahead of everything, for tenants whose limits allow it (`allow_priority`). Any other tenant asking
  is served at `default`, and the response says `default`: OpenAI's own rule for a project without
  the entitlement, so a client that always sends `priority` keeps working everywhere.
- `default` (and `auto`, or nothing): lane 1, the interactive lane.
- `flex`: lane 2, beside batch lines: it runs only in the engine slots batch work may use, so it never
  slows `default` requests, and it is refused at once (429 `resource_unavailable`, `Retry-After`)
  while the model already has `flex_max_queued` flex requests waiting, rather than queueing without
  bound.

The tier a job was served at is stored on it (`jobs.service_tier`), echoed by every object rendered
from it, and counted in `usage_daily` and `spool_service_tier_jobs_total`.
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.errors import DomainError, ErrorKind
from core.infra.metrics import FLEX_REFUSED
from core.infra.orm import Job
from core.states import JobKind, JobState


class Tier(StrEnum):
    priority = "priority"
    default = "default"
    flex = "flex"


# Each tier's lane: lower goes first. Batch lines share the flex lane.
LANE = {Tier.priority: 0, Tier.default: 1, Tier.flex: 2}
BATCH_LANE = 2
LANES = (0, 1, 2)

_PRIORITY_NAMES = frozenset({"priority", "scale", "fast", "ultrafast"})


def resolve(asked: str | None, allow_priority: bool) -> Tier:
    """The tier a request is served at: what it asked for, where its tenant may have it."""
    if asked == "flex":
        return Tier.flex
    if asked in _PRIORITY_NAMES and allow_priority:
        return Tier.priority
    return Tier.default


def lane_of(kind: str, tier: str | None) -> int:
    if kind == JobKind.batch:
        return BATCH_LANE
    try:
        return LANE[Tier(tier or Tier.default)]
    except ValueError:  # a tier this version does not know (a row written by a newer one)
        return LANE[Tier.default]


def ahead_of(tier: Tier) -> list[str]:
    """The tiers whose queued requests a new request of `tier` must not overtake by being sent
    straight to a worker (core/jobs/transitions.py `INSERT`)."""
    return [t.value for t in Tier if LANE[t] <= LANE[tier]]


async def check_flex(sessions: async_sessionmaker[AsyncSession], model: str, bound: int) -> None:
    """Refuse a flex request while `bound` flex requests of its model wait already: one index range
    scan of at most `bound` entries (`ix_jobs_queued_tier`), answered in milliseconds."""
    waiting = (
        select(Job.id)
        .where(
            Job.model == model,
            Job.service_tier == Tier.flex.value,
            Job.state == JobState.queued.value,
            Job.kind == JobKind.interactive.value,
        )
        .limit(bound)
        .subquery()
    )
    async with sessions() as session:
        n = (await session.execute(select(func.count()).select_from(waiting))).scalar_one()
    if n >= bound:
        FLEX_REFUSED.labels(model).inc()
        raise DomainError(
            ErrorKind.rate_limited,
            f"Resource unavailable: the flex tier of '{model}' has {n} requests waiting already; retry later, "
            "or send the request at the default tier.",
            param="service_tier",
            code="resource_unavailable",
            headers={"retry-after": "30"},
        )
