"""/admin: tenants, keys and usage across tenants. Needs an admin-scoped key (else 404)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from api.deps import AdminDep, SessionDep
from api.errors import APIError
from core import tenants
from core.auth import hash_key, new_key
from core.models import ApiKey, Tenant

router = APIRouter(prefix="/admin")

PosInt = Annotated[int, Field(ge=1, le=2**31 - 1)] | None  # Postgres integer columns
BigPosInt = Annotated[int, Field(ge=1, le=2**63 - 1)] | None


class TenantLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    weight: Annotated[int, Field(ge=1, le=1000)] | None = None
    rpm: PosInt = None
    tpm: PosInt = None
    tpd: BigPosInt = None
    max_concurrent: PosInt = None
    max_queued: PosInt = None


class TenantCreate(TenantLimits):
    name: Annotated[str, Field(min_length=1, max_length=128)]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = None
    scope: str = "user"
    expires_in_days: Annotated[float, Field(gt=0)] | None = None
    rpm: PosInt = None
    tpm: PosInt = None


async def _tenant(session, name: str) -> Tenant:
    t = (await session.execute(select(Tenant).where(Tenant.name == name))).scalar()
    if t is None:
        raise APIError(404, f"No tenant named '{name}'.", param="name", code="tenant_not_found")
    return t


@router.get("/tenants")
async def list_tenants(_: AdminDep, session: SessionDep) -> dict:
    rows = (await session.execute(select(Tenant).order_by(Tenant.id))).scalars()
    return {"object": "list", "data": [tenants.tenant_json(t) for t in rows]}


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, _: AdminDep, session: SessionDep) -> dict:
    t = Tenant(name=body.name, **{k: v for k, v in body.model_dump(exclude={"name"}).items() if v is not None})
    session.add(t)
    try:
        await session.commit()
    except IntegrityError as exc:
        raise APIError(409, f"Tenant '{body.name}' already exists.", param="name", code="tenant_exists") from exc
    await session.refresh(t)
    return tenants.tenant_json(t)


@router.patch("/tenants/{name}")
async def update_tenant(name: str, body: TenantLimits, _: AdminDep, session: SessionDep) -> dict:
    await _tenant(session, name)
    values = body.model_dump(exclude_unset=True)  # an explicit null clears a limit
    if "weight" in values and values["weight"] is None:
        raise APIError(400, "weight cannot be null (it is a share, at least 1).", param="weight", code="invalid_value")
    t = (await session.execute(tenants.set_limits(name, values))).scalar() if values else await _tenant(session, name)
    await session.commit()
    return tenants.tenant_json(t)


@router.get("/tenants/{name}/keys")
async def list_keys(name: str, _: AdminDep, session: SessionDep) -> dict:
    t = await _tenant(session, name)
    rows = (await session.execute(select(ApiKey).where(ApiKey.tenant_id == t.id).order_by(ApiKey.id))).scalars()
    return {"object": "list", "data": [tenants.key_json(k) for k in rows]}


@router.post("/tenants/{name}/keys", status_code=201)
async def create_key(name: str, body: KeyCreate, _: AdminDep, session: SessionDep) -> dict:
    if body.scope not in ("user", "admin"):
        raise APIError(400, "scope must be 'user' or 'admin'.", param="scope", code="invalid_value")
    t = await _tenant(session, name)
    plain = new_key()
    expires = datetime.now(UTC) + timedelta(days=body.expires_in_days) if body.expires_in_days else None
    k = ApiKey(
        tenant_id=t.id,
        key_hash=hash_key(plain),
        prefix=plain[:16],
        name=body.name,
        scope=body.scope,
        expires_at=expires,
        rpm=body.rpm,
        tpm=body.tpm,
    )
    session.add(k)
    await session.commit()
    await session.refresh(k)
    return {**tenants.key_json(k), "key": plain}  # the only time the key is shown


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: int, _: AdminDep, session: SessionDep) -> dict:
    k = (await session.execute(tenants.revoke(key_id))).scalar()
    if k is None:
        raise APIError(404, f"No key with id {key_id}.", param="key_id", code="key_not_found")
    await session.commit()
    return tenants.key_json(k)


@router.get("/usage")
async def all_usage(
    _: AdminDep,
    session: SessionDep,
    start: date | None = None,
    end: date | None = None,
    tenant: str | None = None,
    by_key: bool = Query(False),
) -> dict:
    tid = (await _tenant(session, tenant)).id if tenant else None
    rows = (await session.execute(tenants.usage_rows(tid, start, end, by_key))).all()
    return {"object": "list", "data": [tenants.usage_json(r) for r in rows]}
