"""An attempt that finds its job's event stream lost (Redis restarted empty, the fence with it) may
rebuild it only while it still owns the job: a superseded attempt stops without writing the stream
or setting the fence. Real Postgres and Redis, in-process; the null engine's vocabulary."""

from __future__ import annotations

import time

import pytest

from core.generation.events import Delta, decode
from core.infra.streams import keys, write
from core.jobs import transitions
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from ops import factories
from workers.attempt import Attempt
from workers.engine.loop import EngineLoop
from workers.engine.null import NullEngine
from workers.runner import JobRunner

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine_loop():
    return EngineLoop(NullEngine(MODEL, n_ctx=512, max_batch=4))


def _claim(sessions, job_id: str, attempt: int, worker: str, lease_s: float):
    with sessions() as s:
        rows = transitions.claimed(s.execute(*transitions.claim(job_id, attempt, worker, lease_s)))
        s.commit()
    assert len(rows) == 1
    return rows[0]


def _started(session, sessions, rds, it_settings, engine_loop, lease_s: float) -> Attempt:
    """Attempt 1 of a new job, claimed, fenced, with one delta streamed."""
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=8))
    claimed = _claim(sessions, job.id, 1, "w-old", lease_s)
    runner = JobRunner(engine_loop, it_settings, rds, sessions, "w-old")
    runner.lifecycle.appender = None  # this test's appends go straight to Redis
    a = Attempt(runner, claimed)
    write.raise_fence(rds, job.id, 1, 60)
    a._emit([Delta(attempt=1, choice=0, text="first", token_ids=[11])])
    return a


def _redis_lost_everything(rds, job_id: str) -> None:
    rds.delete(keys.stream_key(job_id), keys.fence_key(job_id))


def test_a_superseded_attempt_does_not_rebuild_a_lost_stream_nor_set_the_fence(
    session, sessions, rds, it_settings, engine_loop
):
    a = _started(session, sessions, rds, it_settings, engine_loop, lease_s=0.05)
    job_id = a.job.id
    # Attempt 1's lease lapses; the reaper hands the job to attempt 2, which claims it.
    time.sleep(0.2)
    Lifecycle(sessions, rds, it_settings).reap()
    with sessions() as s:
        assert s.execute(transitions.mark_dispatched(job_id, 2)).first() is not None
        s.commit()
    _claim(sessions, job_id, 2, "w-new", 60)
    _redis_lost_everything(rds, job_id)  # Redis restarted empty before attempt 2 raised its fence

    with pytest.raises(write.Fenced):
        a._emit([Delta(attempt=1, choice=0, text=" stale", token_ids=[12])])
    assert not rds.exists(keys.stream_key(job_id))  # not rebuilt, and nothing of attempt 1 written
    assert rds.get(keys.fence_key(job_id)) is None  # the fence was not set to the old attempt
    # Attempt 2 raises its fence and finds nothing of the superseded attempt in its way.
    assert write.raise_fence(rds, job_id, 2, 60) == 2


def test_the_owning_attempt_rebuilds_its_lost_stream_with_the_same_ids(
    session, sessions, rds, it_settings, engine_loop
):
    a = _started(session, sessions, rds, it_settings, engine_loop, lease_s=60)
    job_id = a.job.id
    before = write.entries(rds, job_id)
    _redis_lost_everything(rds, job_id)

    a._emit([Delta(attempt=1, choice=0, text=" second", token_ids=[12])])
    after = write.entries(rds, job_id)
    assert after[:1] == before  # the same entry id: a reader's Last-Event-ID still points into it
    assert [decode(p).text for _, p in after] == ["first", " second"]
    assert int(rds.get(keys.fence_key(job_id))) == 1


def test_the_pump_finds_a_lost_stream_by_appending_and_rebuilds_it(session, sessions, rds, it_settings, engine_loop):
    """The worker's stream pump asks Redis nothing before it appends (it used to send an EXISTS per
    attempt and second: ~10 % of a worker's CPU with 128 batch lines in flight): an append past
    entry 1 into no stream at all is refused by the script itself, and the attempt rebuilds."""
    from workers.pump import StreamPump

    a = _started(session, sessions, rds, it_settings, engine_loop, lease_s=60)
    job_id = a.job.id
    before = write.entries(rds, job_id)
    _redis_lost_everything(rds, job_id)
    pump = StreamPump(rds, it_settings)
    pump._publish([(a, [Delta(attempt=1, choice=0, text=" second", token_ids=[12])])])
    assert not a.stopped
    after = write.entries(rds, job_id)
    assert after[:1] == before
    assert [decode(p).text for _, p in after] == ["first", " second"]
    assert pump.flushes == 2  # the refused append, then the one after the rebuild
