"""GET /v1/usage: the calling tenant's usage per day and model (and key)."""

from __future__ import annotations

from datetime import date

from fastapi import APIRouter, Query

from api.costs import cheap
from api.deps import RedisDep, SessionDep, SettingsDep, TenantDep
from core.infra.transient import REDIS
from core.protocol import render
from core.protocol.schemas import UsageList
from core.tenancy import quota
from core.tenancy import service as tenancy

router = APIRouter()


@router.get("/v1/usage", response_model=UsageList)
@cheap
async def usage(
    tenant: TenantDep,
    session: SessionDep,
    rds: RedisDep,
    settings: SettingsDep,
    start: date | None = None,
    end: date | None = None,
    by_key: bool = Query(False),
) -> dict:
    rows = (await session.execute(tenancy.usage_rows(tenant.id, start, end, by_key))).mappings()
    out = render.listing([render.usage_row(r) for r in rows])
    # What the tenant stores now, per store (Redis: an upper bound; None when Redis is away, the rest
    # still answers), and its limits: core/tenancy/quota.py.
    counts, limits = await quota.tenant_stored(session, rds, tenant, settings, REDIS)
    out["redis_bytes"] = counts["redis"]
    out["stored_bytes"] = render.stored_bytes(counts, limits)
    return out
