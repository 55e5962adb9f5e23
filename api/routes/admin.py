"""/admin: tenants, keys and usage across tenants. Needs an admin-scoped key (else 404).

Every handler is one call into core/tenancy/service.py, the same functions `spool tenant|key` runs.
"""

from __future__ import annotations

from datetime import date

from anyio.to_thread import run_sync
from fastapi import APIRouter, Query

from api.costs import cheap
from api.deps import AdminDep, SettingsDep, SyncRedisDep, SyncSessionsDep
from core.protocol import render
from core.protocol.schemas import CreatedKey, KeyList, KeyObject, TenantList, TenantObject, UsageList
from core.tenancy import service as tenancy
from core.tenancy.service import KeyCreate, TenantCreate, TenantLimits

router = APIRouter(prefix="/admin")


@router.get("/tenants", response_model=TenantList)
@cheap
async def list_tenants(_: AdminDep, sessions: SyncSessionsDep) -> dict:
    return render.listing([render.tenant(t) for t in await run_sync(tenancy.run, sessions, tenancy.list_tenants)])


@router.post("/tenants", status_code=201, response_model=TenantObject)
@cheap
async def create_tenant(body: TenantCreate, _: AdminDep, sessions: SyncSessionsDep) -> dict:
    return render.tenant(await run_sync(tenancy.run, sessions, tenancy.create_tenant, body))


@router.patch("/tenants/{name}", response_model=TenantObject)
@cheap
async def update_tenant(name: str, body: TenantLimits, _: AdminDep, sessions: SyncSessionsDep) -> dict:
    return render.tenant(await run_sync(tenancy.run, sessions, tenancy.update_tenant, name, body))


@router.get("/tenants/{name}/keys", response_model=KeyList)
@cheap
async def list_keys(name: str, _: AdminDep, sessions: SyncSessionsDep) -> dict:
    return render.listing([render.api_key(k) for k in await run_sync(tenancy.run, sessions, tenancy.list_keys, name)])


@router.post("/tenants/{name}/keys", status_code=201, response_model=CreatedKey)
@cheap
async def create_key(name: str, body: KeyCreate, _: AdminDep, sessions: SyncSessionsDep) -> dict:
    plain, k = await run_sync(tenancy.run, sessions, tenancy.create_key, name, body)
    return render.api_key(k, plain)  # the only time the key is shown


@router.post("/keys/{key_id}/revoke", response_model=KeyObject)
@cheap
async def revoke_key(key_id: int, _: AdminDep, sessions: SyncSessionsDep, rds: SyncRedisDep) -> dict:
    return render.api_key(await run_sync(tenancy.run, sessions, tenancy.revoke_key, rds, key_id))


@router.get("/usage", response_model=UsageList)
@cheap
async def all_usage(
    _: AdminDep,
    sessions: SyncSessionsDep,
    rds: SyncRedisDep,
    settings: SettingsDep,
    start: date | None = None,
    end: date | None = None,
    tenant: str | None = None,
    by_key: bool = Query(False),
) -> dict:
    rows = await run_sync(tenancy.run, sessions, tenancy.usage, tenant, start, end, by_key)
    held = await run_sync(tenancy.run, sessions, tenancy.stored, rds, tenant, settings.ended_events_ttl_s)
    return {**render.listing([render.usage_row(r) for r in rows]), "stored": render.tenants_stored(held)}
