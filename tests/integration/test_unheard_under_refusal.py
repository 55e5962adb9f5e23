"""Issue 49: under OOM, MISCONF or READONLY the dispatcher's reads of Redis still work while every
worker's heartbeat is refused and stands still, so after SPOOL_WORKER_UNHEARD_S it took every worker
for cut and re-queued each running job with its attempt raised (a job on its last attempt failed).
The dispatcher now probes its own writes each pass and judges no worker while they are refused, nor
for a whole unheard window after they succeed again. The refusal is a real one, of a redis-server of
this module's own (CONFIG SET is server-wide: never the shared one); Postgres is the integration
tests' database."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from core.dispatcher import Dispatcher
from core.infra import kv
from core.infra.orm import Job
from core.infra.transient import TRANSIENT
from core.jobs import live_workers
from core.states import JobState
from ops import factories
from ops.bench.paced import private_redis
from ops.harness import free_port, refuse_writes

# wallclock: refusals held past the unheard window (~6 s of wall, little CPU)
pytestmark = [
    pytest.mark.wallclock,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

UNHEARD_S = 0.5
WORKER = "refused-host:1"


@pytest.fixture(scope="module")
def own() -> Iterator[redis_lib.Redis]:
    with private_redis() as (url, _pid):
        rds = kv.client(url)
        yield rds
        rds.close()


def _oom(rds: redis_lib.Redis) -> Callable[[], None]:
    return refuse_writes(rds, "oom", Path("/nonexistent"))  # `maxmemory` 1 under noeviction


def _readonly(rds: redis_lib.Redis) -> Callable[[], None]:
    rds.replicaof("127.0.0.1", free_port())  # a failover made it a replica (of nothing reachable)

    def lift() -> None:
        rds.replicaof("NO", "ONE")

    return lift


def _beat(rds: redis_lib.Redis, model: str) -> None:
    live_workers.beat(rds, model, WORKER, batch_slots=1, interactive_slots=1)


@pytest.mark.parametrize("refuse", [_oom, _readonly])
def test_no_running_jobs_attempt_is_raised_while_redis_refuses_writes(session, sessions, it_settings, own, refuse):
    model = f"refused-{uuid.uuid4().hex[:8]}"  # a model of its own: no other test's worker or job is judged
    t = factories.tenant(session)
    jobs = [factories.job(session, t, state=JobState.running, lease_s=600, model=model) for _ in range(3)]
    for j in jobs:
        j.worker = WORKER
    session.commit()
    # model_copy does not validate: a window far shorter than SPOOL_WORKER_UNHEARD_S allows (5 s)
    d = Dispatcher(sessions, own, own, it_settings.model_copy(update={"models": model, "worker_unheard_s": UNHEARD_S}))
    _beat(own, model)
    assert d._revoke_unheard(session) == 0

    lift = refuse(own)
    try:
        with pytest.raises(TRANSIENT):
            _beat(own, model)  # the worker's heartbeat is refused: it stands still in the hash
        held_until = time.monotonic() + 4 * UNHEARD_S
        while time.monotonic() < held_until:  # the refusal held four unheard windows
            assert d._revoke_unheard(session) == 0
            time.sleep(0.1)  # time passing is the point: the heartbeat stands still meanwhile
    finally:
        lift()
    # Writes are back; the worker's next beat comes up to 2 s later. Until a whole window has passed
    # nobody is judged, although the heartbeat has stood still for longer than a window.
    back = time.monotonic()
    while time.monotonic() - back < 0.8 * UNHEARD_S:
        assert d._revoke_unheard(session) == 0
        time.sleep(0.05)  # the window after the refusal, passing
    _beat(own, model)
    assert d._revoke_unheard(session) == 0
    session.expire_all()
    assert [(session.get(Job, j.id).state, session.get(Job, j.id).attempt) for j in jobs] == [
        (JobState.running.value, 1)
    ] * 3

    # Judging is back: a worker that then stays silent a whole window while writes succeed is judged.
    time.sleep(UNHEARD_S + 0.1)  # the window passing with no heartbeat
    assert d._revoke_unheard(session) == 3
    session.expire_all()
    assert {session.get(Job, j.id).attempt for j in jobs} == {2}
    live_workers.gone(own, model, WORKER)
