"""An idle dispatcher costs one probe a pass (core/dispatcher.py): with no job queued, dispatched or
running, no live batch and no webhook to deliver, its upkeep pass and its batch keeper's pass each
send Postgres one statement, where they sent a full pass of them (reaping, re-sending, picking,
advancing batches, gauges, claiming webhooks: 5 % of a core at the tests' two passes a second, and
Postgres's share on top). Work of each kind brings its part of the pass back. Real Postgres and
Redis, in-process, on a database of the test's own (the probe looks at every job)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import redis as redis_lib
from sqlalchemy import create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from core.config import Settings
from core.dispatcher import Dispatcher
from core.jobs import live_workers
from core.states import BatchStatus, JobState
from ops import factories
from ops.harness import migrated_database
from tests.integration.conftest import IT_DB


@pytest.fixture(scope="module")
def own() -> Iterator[tuple[sessionmaker[Session], list[str]]]:
    """A database no other test writes to, and the statements sent to it."""
    url = f"{IT_DB}_idle"
    migrated_database(url)
    engine = create_engine(url)
    sent: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda _c, _cur, stmt, *_: sent.append(stmt))
    yield sessionmaker(engine, expire_on_commit=False), sent
    engine.dispose()


@pytest.fixture
def dispatcher(own, rds: redis_lib.Redis, it_settings: Settings) -> Dispatcher:
    d = Dispatcher(own[0], rds, rds, it_settings.model_copy(update={"models": "idle-model"}))
    d._send = lambda _s, rows: len(rows)  # type: ignore[method-assign]  # what would go to Celery
    d._next_sweep = math.inf  # the retention sweep (once a minute) is not part of a pass
    d._next_stored = math.inf  # nor the stored-bytes gauges (every 30 s)
    return d


def _statements(own, call) -> list[str]:
    sent = own[1]
    sent.clear()
    call()
    return list(sent)


def _upkeep(d: Dispatcher) -> dict[str, int]:
    d._next_upkeep = 0.0
    return d.tick()


def test_an_idle_pass_is_one_probe_and_work_brings_the_pass_back(own, dispatcher, rds):
    sessions = own[0]
    # A worker with slots for the model: a request is sent only into a live worker's free slot.
    live_workers.beat(rds, "idle-model", "idle-worker", batch_slots=2, interactive_slots=2)
    assert len(_statements(own, lambda: _upkeep(dispatcher))) == 1
    assert len(_statements(own, dispatcher.keep_batches)) == 1
    with sessions() as session:
        t = factories.tenant(session)
        j = factories.job(session, t, model="idle-model")  # queued
    try:
        sent = _statements(own, lambda: _upkeep(dispatcher))
        assert len(sent) > 1 and any("UPDATE jobs" in s for s in sent)  # reaping, re-sending, picking
        with sessions() as session:
            assert session.get(type(j), j.id).state == JobState.dispatched.value  # and it went out
        sent = _statements(own, dispatcher.keep_batches)
        assert len(sent) == 2 and "count(" in sent[1]  # the probe, then the gauges' scan of the backlog
        with sessions() as session:
            b = factories.batch(session, t, status=BatchStatus.in_progress)
        sent = _statements(own, dispatcher.keep_batches)
        assert any("FROM batches" in s and "FOR UPDATE" in s for s in sent)  # advanced: locked and looked at
        with sessions() as session:
            session.get(type(b), b.id).status = BatchStatus.completed.value
            session.get(type(b), b.id).webhook_url = "http://127.0.0.1:9/hook"  # never delivered: no task runs
            session.get(type(j), j.id).state = JobState.succeeded.value
            session.commit()
        sent = _statements(own, dispatcher.keep_batches)
        assert any("pg_advisory_xact_lock" in s for s in sent)  # a webhook to claim
        assert len(_statements(own, lambda: _upkeep(dispatcher))) == 1  # no job unended: idle again
    finally:
        live_workers.gone(rds, "idle-model", "idle-worker")
        with sessions() as session:
            session.execute(type(j).__table__.delete())
            session.execute(type(b).__table__.delete())
            session.commit()
