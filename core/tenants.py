"""Tenant and key administration: statements shared by the CLI (sync) and /admin (async)."""

from __future__ import annotations

from datetime import date
from typing import Any

from sqlalchemy import Select, Update, func, select, update

from core.models import ApiKey, Tenant, UsageDaily

LIMIT_FIELDS = ("weight", "rpm", "tpm", "tpd", "max_concurrent", "max_queued")


def tenant_json(t: Tenant) -> dict[str, Any]:
    return {
        "object": "tenant",
        "id": t.id,
        "name": t.name,
        **{f: getattr(t, f) for f in LIMIT_FIELDS},
        "created_at": int(t.created_at.timestamp()) if t.created_at else None,
    }


def key_json(k: ApiKey) -> dict[str, Any]:
    return {
        "object": "api_key",
        "id": k.id,
        "tenant_id": k.tenant_id,
        "prefix": k.prefix,
        "name": k.name,
        "scope": k.scope,
        "revoked": k.revoked,
        "rpm": k.rpm,
        "tpm": k.tpm,
        "expires_at": int(k.expires_at.timestamp()) if k.expires_at else None,
        "created_at": int(k.created_at.timestamp()) if k.created_at else None,
    }


def set_limits(name: str, values: dict[str, Any]) -> Update:
    bad = set(values) - set(LIMIT_FIELDS)
    if bad:
        raise ValueError(f"unknown tenant fields: {sorted(bad)}")
    return update(Tenant).where(Tenant.name == name).values(**values).returning(Tenant)


def revoke(key_id: int, tenant_id: int | None = None) -> Update:
    stmt = update(ApiKey).where(ApiKey.id == key_id).values(revoked=True).returning(ApiKey)
    return stmt if tenant_id is None else stmt.where(ApiKey.tenant_id == tenant_id)


def usage_rows(tenant_id: int | None, start: date | None, end: date | None, by_key: bool = False) -> Select:
    """Usage per day and model (and key), for one tenant or all."""
    cols = [UsageDaily.day, UsageDaily.tenant_id, UsageDaily.model]
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


def usage_json(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    d["day"] = d["day"].isoformat()
    d["gpu_seconds"] = round(float(d["gpu_seconds"]), 3)
    for k in ("requests", "failed", "prompt_tokens", "completion_tokens"):
        d[k] = int(d[k])
    return d
