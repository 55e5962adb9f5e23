"""Tenants, their limits and their keys: the one implementation behind `spool tenant|key` and
/admin. Functions take a sync Session (and Redis where they need it) and commit; the API runs them
in a thread.

A limit is a positive integer or None (unlimited): `null` in /admin, `none` on the command line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Any, TypeVar

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import RowMapping, Select, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from core.errors import DomainError, ErrorKind, invalid, not_found
from core.infra import redis_keys, transient
from core.infra.orm import ApiKey, Tenant, UsageDaily
from core.protocol.errors import from_validation
from core.states import KeyScope
from core.tenancy import quota
from core.tenancy.keys import SCOPES, hash_key, new_key

log = logging.getLogger(__name__)
PosInt = Annotated[int, Field(ge=1, le=2**31 - 1)] | None  # Postgres integer columns
BigPosInt = Annotated[int, Field(ge=1, le=2**63 - 1)] | None
BigNonNegInt = Annotated[int, Field(ge=0, le=2**63 - 1)] | None
T = TypeVar("T")


class TenantLimits(BaseModel):
    """A tenant's share and limits; a field set to None clears that limit, an unset one is left."""

    model_config = ConfigDict(extra="forbid", strict=True)
    weight: Annotated[int, Field(ge=1, le=1000)] | None = None
    rpm: PosInt = None
    tpm: PosInt = None
    tpd: BigPosInt = None
    max_concurrent: PosInt = None
    max_queued: PosInt = None
    max_storage_bytes: BigPosInt = None  # bytes of uploaded files kept at once
    # Bytes its jobs and batches store in Postgres, and its ended jobs hold in Redis (core/tenancy/quota.py):
    # None, the deployment's default; 0, no limit.
    max_stored_bytes: BigNonNegInt = None
    max_redis_bytes: BigNonNegInt = None
    # May be served at `service_tier: "priority"` (core/jobs/tiers.py); others asking get `default`.
    allow_priority: bool | None = None


class TenantCreate(TenantLimits):
    name: Annotated[str, Field(min_length=1, max_length=128)]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = None
    scope: str = KeyScope.user.value
    expires_in_days: Annotated[float, Field(gt=0, le=36500)] | None = None  # past 100 years: a date overflow
    rpm: PosInt = None
    tpm: PosInt = None


def parse(model: type[BaseModel], values: dict[str, Any]) -> Any:
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from exc


def run(sessions: sessionmaker[Session], fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run one service function in its own session (the CLI; the API from a thread)."""
    with sessions() as session:
        return fn(session, *args, **kw)


# -- tenants -------------------------------------------------------------------------------------


def tenant(session: Session, name: str) -> Tenant:
    t = session.scalar(select(Tenant).where(Tenant.name == name))
    if t is None:
        raise not_found(f"No tenant named '{name}'.", param="name", code="tenant_not_found")
    return t


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.id)))


def create_tenant(session: Session, body: TenantCreate) -> Tenant:
    t = Tenant(name=body.name, **{k: v for k, v in body.model_dump(exclude={"name"}).items() if v is not None})
    session.add(t)
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise DomainError(
            ErrorKind.conflict, f"Tenant '{body.name}' already exists.", param="name", code="tenant_exists"
        ) from exc
    session.refresh(t)
    return t


def update_tenant(session: Session, name: str, body: TenantLimits) -> Tenant:
    values = body.model_dump(exclude_unset=True)  # an explicit None clears a limit
    if "weight" in values and values["weight"] is None:
        raise invalid("weight", "weight cannot be null (it is a share, at least 1).")
    if "allow_priority" in values and values["allow_priority"] is None:
        values["allow_priority"] = False
    t = tenant(session, name)
    if values:
        session.execute(update(Tenant).where(Tenant.id == t.id).values(**values))
        session.commit()
        session.refresh(t)
    return t


# -- keys ----------------------------------------------------------------------------------------


def list_keys(session: Session, tenant_name: str) -> list[ApiKey]:
    t = tenant(session, tenant_name)
    return list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == t.id).order_by(ApiKey.id)))


def add_key(session: Session, t: Tenant, body: KeyCreate) -> tuple[str, ApiKey]:
    if body.scope not in SCOPES:
        raise invalid("scope", "scope must be 'user' or 'admin'.")
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
    session.commit()
    session.refresh(k)
    return plain, k  # the only time the plain key exists


def create_key(session: Session, tenant_name: str, body: KeyCreate) -> tuple[str, ApiKey]:
    return add_key(session, tenant(session, tenant_name), body)


def revoke_key(session: Session, rds: redis.Redis, key_id: int) -> ApiKey:
    k = session.scalar(update(ApiKey).where(ApiKey.id == key_id).values(revoked=True).returning(ApiKey))
    if k is None:
        raise not_found(f"No key with id {key_id}.", param="key_id", code="key_not_found")
    session.commit()
    try:  # API processes cache key lookups for seconds: tell them now
        rds.set(redis_keys.revoked(k.key_hash), 1, ex=3600)
    except transient.REDIS:
        log.warning("could not announce the revocation of key %s; caches drop it within seconds", key_id)
    return k


def ensure_first_key(session: Session, tenant_name: str) -> str | None:
    """A first admin key for a fresh deployment (`spool up`); None if the tenant has keys already."""
    t = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    if t is None:
        t = create_tenant(session, TenantCreate(name=tenant_name))
    if session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == t.id).limit(1)) is not None:
        return None
    plain, _ = add_key(session, t, KeyCreate(name="first", scope=KeyScope.admin.value))
    return plain


# -- usage ---------------------------------------------------------------------------------------


def usage_rows(tenant_id: int | None, start: date | None, end: date | None, by_key: bool = False) -> Select:
    """Usage per day, model and service tier (and key), for one tenant or all."""
    cols = [UsageDaily.day, UsageDaily.tenant_id, UsageDaily.model, UsageDaily.service_tier]
    if by_key:
        cols.append(UsageDaily.key_id)
    stmt = (
        select(
            *cols,
            func.sum(UsageDaily.requests).label("requests"),
            func.sum(UsageDaily.failed).label("failed"),
            func.sum(UsageDaily.prompt_tokens).label("prompt_tokens"),
            func.sum(UsageDaily.completion_tokens).label("completion_tokens"),
            func.sum(UsageDaily.gpu_seconds).label("gpu_seconds"),
        )
        .group_by(*cols)
        .order_by(*cols)
    )
    if tenant_id is not None:
        stmt = stmt.where(UsageDaily.tenant_id == tenant_id)
    if start:
        stmt = stmt.where(UsageDaily.day >= start)
    if end:
        stmt = stmt.where(UsageDaily.day <= end)
    return stmt


def usage(
    session: Session, tenant_name: str | None, start: date | None, end: date | None, by_key: bool
) -> list[RowMapping]:
    tid = tenant(session, tenant_name).id if tenant_name else None
    return list(session.execute(usage_rows(tid, start, end, by_key)).mappings())


def stored(session: Session, rds: redis.Redis, tenant_name: str | None, ended_ttl_s: int) -> dict[int, dict[str, Any]]:
    """Bytes per store of every tenant that stores anything, or of the one named (core/tenancy/quota.py)."""
    tid = tenant(session, tenant_name).id if tenant_name else None
    return quota.all_stored(session, rds, ended_ttl_s, tid)
