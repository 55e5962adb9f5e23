"""Request dependencies: settings, database session, Redis, and the tenant behind the API key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from api.errors import APIError
from core.auth import lookup_tenant_stmt
from core.db import async_sessions
from core.models import Tenant
from core.settings import Settings, get_settings


async def db_session() -> AsyncIterator[AsyncSession]:
    async with async_sessions()() as session:
        yield session


def redis_client(request: Request) -> aioredis.Redis:
    return request.app.state.redis


async def current_tenant(request: Request, session: Annotated[AsyncSession, Depends(db_session)]) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(
            401,
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code="missing_api_key",
            type_="invalid_request_error",
        )
    tenant = (await session.execute(lookup_tenant_stmt(key.strip()))).scalar()
    if tenant is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", type_="invalid_request_error")
    return tenant


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[AsyncSession, Depends(db_session)]
RedisDep = Annotated[aioredis.Redis, Depends(redis_client)]
TenantDep = Annotated[Tenant, Depends(current_tenant)]
