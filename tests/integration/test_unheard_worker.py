"""Issue 39: a worker cut from Redis but not from Postgres kept renewing its leases, so its jobs'
streams stayed silent for the whole partition (40 s in the first cluster run) while another worker
could have resumed them. The dispatcher, which reads both, now ends the leases of a worker Redis has
stopped hearing once its heartbeat has stood still for SPOOL_WORKER_UNHEARD_S by the dispatcher's own clock, and
re-queues its jobs in that same statement. A worker that beats again in time (after a Redis restart
emptied the heartbeat hash) is never judged, nor is one whose clock runs behind, nor anyone while the
dispatcher cannot read Redis itself.
Real Postgres and Redis, in-process; the cluster harness shows it with a real partition
(`python -m ops.cluster --only worker-redis`)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis as redis_lib

from core.dispatcher import Dispatcher
from core.infra import redis_keys
from core.infra.orm import Job
from core.jobs import live_workers
from core.states import JobState
from ops import factories

# wallclock: waits until a worker is unheard (5 s of wall, 0.3 s of CPU in a shard)
# ops/test.sh runs it beside the CPU-bound shards.
pytestmark = pytest.mark.wallclock


@pytest.fixture
def model() -> str:
    return f"unheard-{uuid.uuid4().hex[:8]}"  # a model of its own: no other test's worker or job is judged


def _dispatcher(sessions, rds, it_settings, model: str, unheard_s: float = 0.5) -> Dispatcher:
    # model_copy does not validate: a window far shorter than SPOOL_WORKER_UNHEARD_S allows (5 s)
    d = Dispatcher(sessions, rds, rds, it_settings.model_copy(update={"models": model, "worker_unheard_s": unheard_s}))
    d._send = lambda _s, rows: len(rows)  # type: ignore[method-assign]  # what would go to Celery
    return d


def _held(session, t, worker: str, model: str) -> Job:
    j = factories.job(session, t, state=JobState.running, lease_s=600, model=model)  # renewed far ahead
    j.worker = worker
    session.commit()
    return j


def _upkeep(d: Dispatcher) -> dict[str, int]:
    d._next_upkeep = 0.0
    return d.tick()


def test_a_worker_redis_stopped_hearing_loses_its_jobs_to_others(session, sessions, rds, it_settings, model):
    t = factories.tenant(session)
    cut, fine = _held(session, t, "cut-host:1", model), _held(session, t, "fine-host:2", model)
    live_workers.beat(rds, model, "fine-host:2", batch_slots=1, interactive_slots=1)  # Redis hears this one
    d = _dispatcher(sessions, rds, it_settings, model)
    try:
        assert "revoked" not in _upkeep(d)  # silent, but not yet for its unheard window
        time.sleep(0.6)
        live_workers.beat(rds, model, "fine-host:2", batch_slots=1, interactive_slots=1)
        assert _upkeep(d)["revoked"] == 1
        session.expire_all()
        # Re-queued with the next attempt, and sent on in the same pass: another worker resumes it.
        assert cut.attempt == 2 and cut.state in (JobState.queued.value, JobState.dispatched.value)
        assert (fine.state, fine.attempt) == (JobState.running.value, 1)
    finally:
        live_workers.gone(rds, model, "fine-host:2")


def test_a_worker_that_beats_again_in_time_is_never_judged(session, sessions, rds, it_settings, model):
    """Redis restarted empty: every worker is missing from the hash until its next beat (2 s)."""
    t = factories.tenant(session)
    j = _held(session, t, "slow-host:3", model)
    d = _dispatcher(sessions, rds, it_settings, model)
    try:
        _upkeep(d)  # missing: its silence starts being counted
        live_workers.beat(rds, model, "slow-host:3", batch_slots=1, interactive_slots=1)
        time.sleep(0.6)
        assert "revoked" not in _upkeep(d)
        session.expire_all()
        assert (j.state, j.attempt) == (JobState.running.value, 1)
    finally:
        live_workers.gone(rds, model, "slow-host:3")


def test_a_worker_whose_clock_runs_behind_is_heard_all_the_same(session, sessions, rds, it_settings, model):
    """Its heartbeats carry times a minute old by the dispatcher's clock, but they move."""
    t = factories.tenant(session)
    j = _held(session, t, "behind-host:5", model)
    d = _dispatcher(sessions, rds, it_settings, model)

    def beat_a_minute_behind() -> None:
        body = {"batch_slots": 1, "interactive_slots": 1, "t": time.time() - 60}
        rds.hset(redis_keys.live_workers(model), "behind-host:5", json.dumps(body))

    try:
        for _ in range(3):
            beat_a_minute_behind()
            assert "revoked" not in _upkeep(d)
            time.sleep(0.3)
        session.expire_all()
        assert (j.state, j.attempt) == (JobState.running.value, 1)
    finally:
        live_workers.gone(rds, model, "behind-host:5")


def test_nobody_is_judged_while_the_dispatcher_cannot_read_redis(session, sessions, it_settings, model):
    """An outage, not a cut: the workers are as deaf as the dispatcher."""
    t = factories.tenant(session)
    j = _held(session, t, "any-host:4", model)
    nowhere = redis_lib.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens on port 1
    d = _dispatcher(sessions, nowhere, it_settings, model, unheard_s=0.0)
    assert d._revoke_unheard(session) == 0
    session.expire_all()
    assert (j.state, j.attempt) == (JobState.running.value, 1)
