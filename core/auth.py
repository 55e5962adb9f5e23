"""API keys: generated once, stored as sha256, looked up by hash."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from core.models import ApiKey, Tenant

KEY_PREFIX = "sk-spool-"
SCOPES = frozenset({"user", "admin"})


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def lookup_stmt(key: str):
    """SELECT (tenant, key) for a live key: not revoked, not expired. Run it on a sync or an async
    session. It is read on every request, so a revocation takes effect on the next one."""
    return (
        select(Tenant, ApiKey)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(
            ApiKey.key_hash == hash_key(key),
            ApiKey.revoked.is_(False),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > func.now()),
        )
    )


def create_tenant(session: Session, name: str) -> Tenant:
    tenant = Tenant(name=name)
    session.add(tenant)
    session.flush()
    return tenant


def create_key(
    session: Session,
    tenant: Tenant,
    name: str | None = None,
    *,
    scope: str = "user",
    expires_at: datetime | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
) -> tuple[str, ApiKey]:
    """Store a new key for `tenant` and return it: the only time the plain key exists."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {sorted(SCOPES)}")
    key = new_key()
    row = ApiKey(
        tenant_id=tenant.id,
        key_hash=hash_key(key),
        prefix=key[:16],
        name=name,
        scope=scope,
        expires_at=expires_at,
        rpm=rpm,
        tpm=tpm,
    )
    session.add(row)
    session.flush()
    return key, row


def tenant_by_name(session: Session, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name))
