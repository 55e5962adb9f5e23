"""API keys: generated once, stored as sha256, looked up by hash."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import func, or_, select

from core.infra.orm import ApiKey, Tenant
from core.states import KeyScope

KEY_PREFIX = "sk-spool-"
SCOPES = frozenset(KeyScope)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant and the key it used."""

    tenant: Tenant
    key: ApiKey


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
