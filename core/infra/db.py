"""Database engines: a sync one for workers, the dispatcher and the CLI, an async one for the API.

Both use psycopg 3, so the SQL in core/jobs/transitions.py runs unchanged on either.
"""

from __future__ import annotations

import time
from functools import lru_cache

import psycopg
from psycopg import sql
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from core.config import Settings, get_settings

# An unreachable Postgres fails a connection attempt in seconds (then callers retry). The API's
# statements are short: none may hold a connection for more than a minute (batch validation's long
# COPY runs on the sync engine, in the dispatcher).
# A Postgres host that vanishes (powered off, partitioned: no FIN, no RST) must not hold a caller for
# TCP's own ~15 minutes of retransmissions: libpq's keepalives probe an idle connection after 10 s,
# and `tcp_user_timeout` (which on Linux also bounds the probes) drops a connection whose data or
# probes go unacknowledged for 30 s. Options a platform's libpq lacks are ignored by it.
_CONNECT = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
_API_STATEMENT_MS = 60_000


def connect_args(settings: Settings, *, api: bool = False) -> dict[str, object]:
    """Connection arguments of Spool's engines. Every connection tells Postgres to end a session left
    idle inside a transaction for SPOOL_DB_IDLE_TRANSACTION_S (`idle_in_transaction_session_timeout`):
    a caller that hangs mid-transaction (a dead client, a stuck thread) never holds its locks or its
    connection for long; and to close a session left idle outside one for SPOOL_DB_IDLE_SESSION_S
    (`idle_session_timeout`), which with the pools' last-in-first-out order (`POOLS`) gives back what a
    burst opened. The API's also bound each statement (`statement_timeout`)."""
    idle_ms = int(settings.db_idle_transaction_s * 1000)
    options = f"-c idle_in_transaction_session_timeout={idle_ms}"
    options += f" -c idle_session_timeout={int(settings.db_idle_session_s * 1000)}"
    if api:
        options += f" -c statement_timeout={_API_STATEMENT_MS}"
    return {**_CONNECT, "options": options}


# The pools: the most recently returned connection goes out first, so under a steady load the same few
# stay busy and the rest sit idle until Postgres closes them (idle_session_timeout, above); the ping of
# a connection idle PING_IDLE_S replaces one it closed. First in, first out kept all of a burst's
# connections warm for good: every stack of a test run held its pools' 20 + 10 and Postgres ran out.
POOLS: dict[str, object] = {"pool_use_lifo": True}

# A pooled connection idle at least this long is pinged before use (see `ping_when_idle`).
PING_IDLE_S = 1.0


def ping_when_idle(engine: Engine, idle_s: float = PING_IDLE_S) -> Engine:
    """`pool_pre_ping`, for connections that sat in the pool `idle_s` or more. pre_ping sent a
    `SELECT 1` before every statement: under load a third of the round trips of a short job (the
    API's INSERT, the worker's claim and end), a connection back in the pool for milliseconds. A
    connection Postgres dropped meanwhile (a restart lasts longer than `idle_s`; and a failed
    statement invalidates the whole pool) is found by the ping, replaced, and never seen by a caller."""
    dialect = engine.dialect

    @event.listens_for(engine, "checkin")
    def _returned(_dbapi: object, record: object) -> None:
        record.info["idle_since"] = time.monotonic()  # type: ignore[attr-defined]

    @event.listens_for(engine, "checkout")
    def _taken(dbapi: object, record: object, _proxy: object) -> None:
        since = record.info.get("idle_since")  # type: ignore[attr-defined]  # none: just connected
        if since is None or time.monotonic() - since < idle_s:
            return
        try:
            alive = dialect.do_ping(dbapi)  # type: ignore[arg-type]
        except Exception as exc:  # the pool replaces the connection and tries again
            raise DisconnectionError("connection lost while idle") from exc
        if not alive:
            raise DisconnectionError("connection lost while idle")

    return engine


@lru_cache
def sync_engine() -> Engine:
    return ping_when_idle(
        create_engine(
            get_settings().database_url,
            pool_size=10,
            max_overflow=20,
            connect_args=connect_args(get_settings()),
            **POOLS,
        )
    )


@lru_cache
def sync_sessions() -> sessionmaker:
    return sessionmaker(sync_engine(), expire_on_commit=False)


@lru_cache
def async_engine() -> AsyncEngine:
    engine = create_async_engine(
        get_settings().database_url,
        pool_size=20,
        max_overflow=40,
        pool_timeout=10,
        connect_args=connect_args(get_settings(), api=True),
        **POOLS,
    )
    ping_when_idle(engine.sync_engine)
    return engine


@lru_cache
def async_sessions() -> async_sessionmaker:
    return async_sessionmaker(async_engine(), expire_on_commit=False)


class Listener:
    """Waits for a Postgres NOTIFY on one channel, on a connection of its own (a LISTEN holds it).

    A notification is a hint, never the only way work is found: Postgres away, or a restart between
    a NOTIFY and the LISTEN, turns a wait into a plain sleep of the same length, and the next wait
    connects again. Notifications sent while the caller was busy are queued on the connection and
    end the next wait at once."""

    def __init__(self, engine: Engine, channel: str) -> None:
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._channel = channel
        self._conn: psycopg.Connection | None = None

    def wait(self, timeout: float) -> str | None:
        """The payload of a notification that came within `timeout` seconds, else None."""
        if timeout <= 0:
            return None
        try:
            conn = self._listen()
            return next((n.payload for n in conn.notifies(timeout=timeout, stop_after=1)), None)
        except (psycopg.Error, OSError):
            self.close()
            time.sleep(timeout)
            return None

    def start(self) -> None:
        """Listen from now on (a wait does it too): call before the first look for work, so nothing
        sent between that look and the first wait is missed."""
        try:
            self._listen()
        except (psycopg.Error, OSError):
            self.close()

    def _listen(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._conninfo, autocommit=True, connect_timeout=_CONNECT["connect_timeout"])
            self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
