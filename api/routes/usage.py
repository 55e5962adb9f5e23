"""GET /v1/usage: the calling tenant's usage per day and model (and key)."""

from __future__ import annotations

from datetime import date

from fastapi import APIRouter, Query

from api.costs import cheap
from api.deps import SessionDep, TenantDep
from core.protocol import render
from core.protocol.schemas import UsageList
from core.tenancy import service as tenancy

router = APIRouter()


@router.get("/v1/usage", response_model=UsageList)
@cheap
async def usage(
    tenant: TenantDep,
    session: SessionDep,
    start: date | None = None,
    end: date | None = None,
    by_key: bool = Query(False),
) -> dict:
    rows = (await session.execute(tenancy.usage_rows(tenant.id, start, end, by_key))).mappings()
    return render.listing([render.usage_row(r) for r in rows])
