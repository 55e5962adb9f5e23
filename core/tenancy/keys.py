"""API keys: generated once, stored as sha256, looked up by hash."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

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


_LIVE = (ApiKey.revoked.is_(False), or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > func.now()))


def lookup_stmt(key: str):
    """SELECT (tenant, key) for a live key: not revoked, not expired. Run it on a sync or an async
    session. It is read on every request, so a revocation takes effect on the next one."""
    return (
        select(Tenant, ApiKey)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key), *_LIVE)
    )


async def principal_of(sessions: async_sessionmaker[AsyncSession], key: str) -> Principal | None:
    """Who calls with this key (None: no live key), read in a short session of its own: a long
    stream must not hold a database connection."""
    async with sessions() as s:
        row = (await s.execute(lookup_stmt(key))).first()
    return None if row is None else Principal(row[0], row[1])


async def is_live_admin(sessions: async_sessionmaker[AsyncSession], digest: str) -> bool:
    """Whether the key whose SHA-256 is `digest` is live and admin-scoped (the status page's login
    keeps only the digest)."""
    async with sessions() as s:
        found = await s.scalar(
            select(ApiKey.id).where(ApiKey.key_hash == digest, ApiKey.scope == KeyScope.admin.value, *_LIVE)
        )
    return found is not None
