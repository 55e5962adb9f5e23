"""In-process integration tests: core services against the real Postgres and Redis of this
machine, on a database and a Redis db of their own, with no Spool process running."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import redis as redis_lib
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from core.config import Settings
from tests.conftest import IT_REDIS, ROOT, TEST_DB

# spool_test -> spool_it; spool_test_<name> -> spool_it_<name>: sessions running side by side each drop their own.
_BASE, _NAME = TEST_DB.rsplit("/", 1)
IT_DB = f"{_BASE}/{_NAME.replace('spool_test', 'spool_it', 1) if 'spool_test' in _NAME else _NAME + '_it'}"


@pytest.fixture(scope="session")
def it_settings() -> Settings:
    return Settings(database_url=IT_DB, redis_url=IT_REDIS, max_attempts=2)


@pytest.fixture(scope="session")
def sessions(it_settings: Settings) -> Iterator[sessionmaker[Session]]:
    from core.infra.dbadmin import drop_database

    drop_database(IT_DB)
    env = {**os.environ, "SPOOL_DATABASE_URL": IT_DB}
    out = subprocess.run([sys.executable, "-m", "core.cli", "migrate"], env=env, cwd=ROOT, capture_output=True)
    assert out.returncode == 0, out.stderr[-2000:]
    engine = create_engine(IT_DB)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


@pytest.fixture
def session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sessions() as s:
        yield s


@pytest.fixture(scope="session")
def rds() -> redis_lib.Redis:
    r = redis_lib.Redis.from_url(IT_REDIS)
    r.flushdb()
    return r


def reset_globals() -> None:
    """Settings and engines are cached per process: dropped so the server (and what runs after it)
    reads the environment it is given."""
    from core.config import get_settings
    from core.infra import db

    get_settings.cache_clear()
    for cached in (db.sync_sessions, db.async_sessions, db.async_engine):
        cached.cache_clear()
    if db.sync_engine.cache_info().currsize:
        db.sync_engine().dispose()
    db.sync_engine.cache_clear()


@contextmanager
def spool_env(env: dict[str, str]) -> Iterator[None]:
    """The process environment with `env` in it and Spool's cached settings and engines read anew, for
    an app a module builds in process (a module's fixture has no monkeypatch); both restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    reset_globals()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_globals()


@dataclass(frozen=True)
class Served:
    """An API served in this process (`served_api`)."""

    base: str
    port: int
    loop_thread: int  # the event loop's thread


@contextmanager
def served_api(env: dict[str, str]) -> Iterator[Served]:
    """The API app made under `env` (spool_env) and served by uvicorn on a thread of this process, on a
    free port, until the block ends."""
    import threading

    import uvicorn

    from tests.conftest import free_port, wait_for

    with spool_env(env):
        from api.app import create_app

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for(lambda: server.started, 60, "the in-process API to start")
        try:
            yield Served(f"http://127.0.0.1:{port}", port, thread.ident or 0)
        finally:
            server.should_exit = True
            thread.join(30)
