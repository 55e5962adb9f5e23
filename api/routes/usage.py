"""GET /v1/usage: the calling tenant's usage per day and model (and key)."""

from __future__ import annotations

from datetime import date

from fastapi import APIRouter, Query

from api.costs import cheap
from api.deps import RedisDep, SessionDep, SettingsDep, TenantDep
from core.infra.transient import REDIS
from core.protocol import render
from core.protocol.schemas import UsageList
from core.tenancy import service as tenancy
from core.tenancy import usage as stored

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
    try:  # what the tenant's ended jobs hold in Redis now, an upper bound (see core/tenancy/usage.py)
        out["redis_bytes"] = await stored.tenant_redis_bytes(rds, settings.ended_events_ttl_s, tenant.id)
    except REDIS:
        out["redis_bytes"] = None  # Redis away: the usage rows still answer
    return out
