"""Request dependencies: settings, database session, Redis, and who is calling (tenant + key)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import redis
import redis.asyncio as aioredis
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from api.errors import APIError
from api.guard import authenticate
from core.config import Settings, get_settings
from core.idempotency import Idempotency
from core.infra.orm import Tenant
from core.infra.streams import read
from core.jobs.lifecycle import Lifecycle
from core.jobs.service import Completions
from core.protocol.render import Fingerprints
from core.states import KeyScope
from core.tenancy.keys import Principal


async def db_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.async_sessions() as session:
        yield session


# Every dependency here is `async def`: FastAPI runs a plain `def` dependency on its thread pool, a
# thread hop per dependency per request (about 6 % of the API's CPU on short jobs) to read app.state.
async def settings() -> Settings:
    return get_settings()


async def redis_client(request: Request) -> aioredis.Redis:
    return request.app.state.redis


async def stream_hub(request: Request) -> read.Hub:
    return request.app.state.hub


async def lifecycle(request: Request) -> Lifecycle:
    return request.app.state.lifecycle


# The services and sessions api/app.py builds at startup, injected into the routes that call them.
async def completions(request: Request) -> Completions:
    return request.app.state.completions


async def idempotency(request: Request) -> Idempotency:
    return request.app.state.idempotency


async def fingerprints(request: Request) -> Fingerprints:
    return request.app.state.fingerprints


async def sync_sessions(request: Request) -> sessionmaker[Session]:
    """For sync services run in a thread (uploads, tenancy)."""
    return request.app.state.sync_sessions


async def async_sessions_of(request: Request) -> async_sessionmaker[AsyncSession]:
    """For async services given their sessions (files: each step a short session of its own)."""
    return request.app.state.async_sessions


async def sync_redis(request: Request) -> redis.Redis:
    return request.app.state.sync_redis


async def current_principal(request: Request) -> Principal:
    """Set by api/guard.py for requests with a body (authenticated before the body is read); looked
    up here for the others."""
    known = getattr(request.state, "principal", None)
    if known is not None:
        return known
    state = request.app.state
    return await authenticate(request.headers.get("authorization"), state.redis, state.async_sessions)


async def current_tenant(principal: Annotated[Principal, Depends(current_principal)]) -> Tenant:
    return principal.tenant


async def admin_principal(principal: Annotated[Principal, Depends(current_principal)]) -> Principal:
    if principal.key.scope != KeyScope.admin:
        # Same answer as an unknown route: an ordinary key learns nothing about /admin.
        raise APIError(404, "Unknown request URL. Please check the URL for typos.")
    return principal


SettingsDep = Annotated[Settings, Depends(settings)]
SessionDep = Annotated[AsyncSession, Depends(db_session)]
RedisDep = Annotated[aioredis.Redis, Depends(redis_client)]
HubDep = Annotated[read.Hub, Depends(stream_hub)]
LifecycleDep = Annotated[Lifecycle, Depends(lifecycle)]
CompletionsDep = Annotated[Completions, Depends(completions)]
IdempotencyDep = Annotated[Idempotency, Depends(idempotency)]
FingerprintsDep = Annotated[Fingerprints, Depends(fingerprints)]
SyncSessionsDep = Annotated[sessionmaker[Session], Depends(sync_sessions)]
AsyncSessionsDep = Annotated[async_sessionmaker[AsyncSession], Depends(async_sessions_of)]
SyncRedisDep = Annotated[redis.Redis, Depends(sync_redis)]
PrincipalDep = Annotated[Principal, Depends(current_principal)]
TenantDep = Annotated[Tenant, Depends(current_tenant)]
AdminDep = Annotated[Principal, Depends(admin_principal)]
