"""Database engines: a sync one for workers, the dispatcher and the CLI, an async one for the API.

Both use psycopg 3, so the SQL in core/jobs/transitions.py runs unchanged on either.
"""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from core.config import get_settings

# An unreachable Postgres fails a connection attempt in seconds (then callers retry). The API's
# statements are short: none may hold a connection for more than a minute (batch validation's long
# COPY runs on the sync engine, in the dispatcher).
_CONNECT = {"connect_timeout": 5}
_API_CONNECT = {**_CONNECT, "options": "-c statement_timeout=60000"}


@lru_cache
def sync_engine() -> Engine:
    return create_engine(
        get_settings().database_url, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args=_CONNECT
    )


@lru_cache
def sync_sessions() -> sessionmaker:
    return sessionmaker(sync_engine(), expire_on_commit=False)


@lru_cache
def async_engine() -> AsyncEngine:
    return create_async_engine(
        get_settings().database_url,
        pool_pre_ping=True,
        pool_size=20,
        max_overflow=40,
        pool_timeout=10,
        connect_args=_API_CONNECT,
    )


@lru_cache
def async_sessions() -> async_sessionmaker:
    return async_sessionmaker(async_engine(), expire_on_commit=False)
