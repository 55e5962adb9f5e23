"""Pooled connections are pinged only after sitting idle (core/infra/db.ping_when_idle): one used again
at once costs no `SELECT 1`, and one that Postgres dropped while it sat idle is replaced before any
caller sees it. Real Postgres; the backend is terminated by Postgres itself."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from core.infra.db import ping_when_idle
from tests.integration.conftest import IT_DB

IDLE_S = 0.3


def _counting(engine) -> list[int]:
    pings: list[int] = []
    real = engine.dialect.do_ping
    engine.dialect.do_ping = lambda conn: pings.append(1) or real(conn)
    return pings


def _terminate(pid: int) -> None:
    admin = create_engine(IT_DB, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    finally:
        admin.dispose()


def test_a_busy_connection_is_not_pinged_and_a_dropped_idle_one_is_replaced():
    engine = ping_when_idle(create_engine(IT_DB, pool_size=1, max_overflow=0), idle_s=IDLE_S)
    pings = _counting(engine)
    pid = "SELECT pg_backend_pid()"
    try:
        with engine.connect() as conn:
            first = conn.execute(text(pid)).scalar()
        for _ in range(5):  # back in the pool for microseconds each time: no ping
            with engine.connect() as conn:
                assert conn.execute(text(pid)).scalar() == first
        assert pings == []

        _terminate(first)
        time.sleep(IDLE_S + 0.1)
        with engine.connect() as conn:  # no error reaches the caller: the ping found it dead
            second = conn.execute(text(pid)).scalar()
        assert second != first and pings == [1]
    finally:
        engine.dispose()


def test_the_async_engine_too():
    async def main() -> tuple[int, int, list[int]]:
        engine = create_async_engine(IT_DB, pool_size=1, max_overflow=0)
        ping_when_idle(engine.sync_engine, idle_s=IDLE_S)
        pings = _counting(engine.sync_engine)
        try:
            async with engine.connect() as conn:
                first = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar()
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar() == first
            assert pings == []
            await asyncio.to_thread(_terminate, first)
            await asyncio.sleep(IDLE_S + 0.1)
            async with engine.connect() as conn:
                second = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar()
            return first, second, pings
        finally:
            await engine.dispose()

    first, second, pings = asyncio.run(main())
    assert second != first and pings == [1]
