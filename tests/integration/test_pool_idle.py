"""A pool gives back what a burst opened (core/infra/db.py: POOLS and `idle_session_timeout`): the
most recently returned connection goes out first, so a steady load after a burst keeps using the same
few and Postgres closes the rest once they sit idle SPOOL_DB_IDLE_SESSION_S; the next checkout of one
it closed is replaced by the pool's ping, never seen by the caller. With first-in-first-out (the old
pools) the same load touches every connection in turn, none idles, and all of them stay open: every
stack of a test run kept its pools' 20 + 10 connections and Postgres ran out of its 100."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from core.config import Settings
from core.infra import db
from tests.integration.conftest import IT_DB

BURST = 8
IDLE_S = 2.0


def _open(engine) -> int:
    """This engine's connections Postgres has open (its own application_name)."""
    admin = create_engine(IT_DB, poolclass=NullPool)  # its own connection closed at once: never counted
    with admin.connect() as conn:
        q = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"
        return conn.scalar(text(q), {"a": engine.url.query["application_name"]})


def _pool(lifo: bool, name: str):
    url = f"{IT_DB}?application_name={name}"
    args = db.connect_args(Settings(db_idle_session_s=IDLE_S))
    return db.ping_when_idle(
        create_engine(url, pool_size=BURST, max_overflow=0, connect_args=args, **{**db.POOLS, "pool_use_lifo": lifo})
    )


def _burst(engine) -> None:
    gate = threading.Barrier(BURST)

    def hold() -> None:
        with engine.connect() as conn:
            gate.wait(10)  # all BURST checked out at once
            conn.execute(text("SELECT 1"))
            conn.commit()

    threads = [threading.Thread(target=hold) for _ in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _steady(engine, seconds: float) -> None:
    """One statement at a time, every 0.2 s: a light load that never needs more than one connection."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT 1")) == 1  # a connection Postgres closed is never handed out
        time.sleep(0.2)


@pytest.mark.usefixtures("sessions")  # IT_DB made
@pytest.mark.parametrize("lifo", [True, False], ids=["lifo", "fifo"])
def test_a_burst_s_connections_are_given_back_under_a_steady_load(lifo):
    engine = _pool(lifo, f"pool-idle-{'lifo' if lifo else 'fifo'}")
    try:
        _burst(engine)
        assert _open(engine) == BURST
        _steady(engine, IDLE_S * 2.5)  # time passing is the point: past the idle timeout
        if lifo:
            assert _open(engine) <= 2, "the burst's connections were closed once idle"
        else:
            assert _open(engine) == BURST, "first-in-first-out kept every one of them busy enough to stay open"
        _burst(engine)  # what Postgres closed is replaced, not handed out broken
        assert _open(engine) == BURST
    finally:
        engine.dispose()


def test_the_setting_is_0_or_at_least_2_seconds():
    assert Settings(db_idle_session_s=0).db_idle_session_s == 0
    with pytest.raises(ValueError, match="at least 2 seconds"):
        Settings(db_idle_session_s=1)
