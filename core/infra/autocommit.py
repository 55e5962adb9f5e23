"""Single statements as their own transactions, on the engine behind a given session factory."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, Row
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import sessionmaker


@lru_cache
def _autocommit(engine: Engine) -> Engine:
    return engine.execution_options(isolation_level="AUTOCOMMIT")  # shares `engine`'s pool


def one_statement(sessions: sessionmaker, stmt: Any, params: Any = None) -> list[Row]:
    """Run one statement as its own transaction on `sessions`' engine and return its rows. In
    autocommit a single statement is atomic and costs one round trip, where an ORM session spends
    three (BEGIN, the statement, COMMIT) and its unit-of-work machinery: for a worker's hot,
    single-statement transitions (claim, end) that was most of their CPU."""
    with _autocommit(sessions.kw["bind"]).connect() as conn:
        result = conn.execute(stmt, params)
        return list(result) if result.returns_rows else []


@lru_cache
def _autocommit_async(engine: AsyncEngine) -> AsyncEngine:
    return engine.execution_options(isolation_level="AUTOCOMMIT")


async def one_statement_async(sessions: async_sessionmaker, stmt: Any, params: Any = None) -> list[Row]:
    """`one_statement` on an async session factory's engine (the API's)."""
    async with _autocommit_async(sessions.kw["bind"]).connect() as conn:
        result = await conn.execute(stmt, params)
        return list(result) if result.returns_rows else []
