"""API keys: generated once, stored as sha256, looked up by hash."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.models import ApiKey, Tenant

KEY_PREFIX = "sk-spool-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def lookup_tenant_stmt(key: str):
    """SELECT of the tenant owning a live key; run it on a sync or an async session."""
    return (
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked.is_(False))
    )


def create_tenant(session: Session, name: str) -> Tenant:
    tenant = Tenant(name=name)
    session.add(tenant)
    session.flush()
    return tenant


def create_key(session: Session, tenant: Tenant, name: str | None = None) -> str:
    """Store a new key for `tenant` and return it: the only time the plain key exists."""
    key = new_key()
    session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:16], name=name))
    session.flush()
    return key


def tenant_by_name(session: Session, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name))
