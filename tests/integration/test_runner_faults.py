"""The worker's runner against faults that are not a crash: a newer attempt took over (fencing), and
an engine that wedges inside a step. Real Postgres and Redis, in-process; the engine is the null
engine (real vocabulary), made to hang where the test says."""

from __future__ import annotations

import threading
import time

import pytest

from core.generation.events import Delta, encode
from core.infra.orm import Job
from core.infra.streams import keys, read, write
from core.jobs import transitions
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from ops import factories
from tests.conftest import wait_for
from workers.engine.loop import EngineLoop
from workers.engine.null import NullEngine
from workers.runner import JobRunner

MODEL = "smollm2-135m-instruct"


def test_a_superseded_attempt_cannot_write_the_stream(rds, it_settings):
    job_id = "job-fence-" + str(time.time_ns())
    assert write.raise_fence(rds, job_id, 2, 60) == 2
    assert write.raise_fence(rds, job_id, 1, 60) == 2  # never lowered
    late = encode(Delta(attempt=1, choice=0, text="stale", token_ids=[1]))
    with pytest.raises(write.Fenced):
        write.append_fenced(rds, job_id, 1, [late], 60, start=1)
    assert write.entries(rds, job_id) == []
    ok = encode(Delta(attempt=2, choice=0, text="fresh", token_ids=[2]))
    assert len(write.append_fenced(rds, job_id, 2, [ok], 60, start=1)) == 1
    assert [p for _, p in write.entries(rds, job_id)] == [ok]


@pytest.fixture(scope="module")
def engine_loop():
    return EngineLoop(NullEngine(MODEL, n_ctx=512, max_batch=4))


def test_an_attempt_that_was_superseded_stops_and_writes_nothing(session, sessions, rds, it_settings, engine_loop):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=8))
    write.raise_fence(rds, job.id, 2, 60)  # attempt 2 claimed it meanwhile (its lease lapsed, say)
    runner = JobRunner(engine_loop, it_settings, rds, sessions, "w-test")
    assert runner.run(job.id, 1) == "lost"
    assert write.entries(rds, job.id) == []


class WedgingEngine(NullEngine):
    """Hangs inside `step` until released, as a stuck CUDA kernel or a deadlocked library would."""

    def __init__(self) -> None:
        super().__init__(MODEL, n_ctx=512, max_batch=4)
        self.release = threading.Event()

    def step(self):
        self.release.wait(60)
        return super().step()


def test_a_wedged_engine_stops_renewing_and_lets_its_job_go(session, sessions, rds, it_settings):
    settings = it_settings.model_copy(update={"engine_stall_s": 0.5, "lease_s": 1.5})
    engine = WedgingEngine()
    loop = EngineLoop(engine)
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=8))
    runner = JobRunner(loop, settings, rds, sessions, "w-wedged")
    try:
        started = time.monotonic()
        assert runner.run(job.id, 1) == "abandoned"  # it did not keep the job it cannot finish
        assert loop.stalled_for() > 0.5
        assert time.monotonic() - started < 30
        # Its lease was not renewed: it lapses, and the reaper hands the job to the next attempt.
        wait_for(lambda: Lifecycle(sessions, rds, settings).reap()["requeued"] == 1, 10, "the reaper")
        row = session.get(Job, job.id, populate_existing=True)
        assert (row.state, row.attempt) == ("queued", 2)
        assert session.execute(transitions.renew_lease(job.id, 1, 30)).first() is None  # attempt 1 is over
    finally:
        engine.release.set()


def test_a_retried_append_writes_nothing_twice_and_a_lost_stream_keeps_its_ids(rds):
    """Issue 24, found by the fault harness: Redis died after writing an append but before answering
    it; the attempt sent it again into the stream rebuilt after Redis came back empty, under new
    time-based ids, and a client whose Last-Event-ID was one of the lost entries received those
    tokens a second time (its text had a phrase twice). Entries are positional now."""
    job_id = "job-pos-" + str(time.time_ns())
    write.raise_fence(rds, job_id, 1, 60)
    evs = [encode(Delta(attempt=1, choice=0, text=f" t{i}", token_ids=[i])) for i in range(1, 6)]
    first = write.append_fenced(rds, job_id, 1, evs[:3], 60, start=1)
    # The answer to this append is lost; the attempt sends it again.
    again = write.append_fenced(rds, job_id, 1, evs[:3], 60, start=1)
    assert again == first and [p for _, p in write.entries(rds, job_id)] == evs[:3]
    client_saw = first[-1]  # a reader's Last-Event-ID
    # Redis comes back empty: the attempt rebuilds what it had logged (the first entry only: the
    # others' answer was lost), then sends the rest again, from where its log ends.
    rds.delete(keys.stream_key(job_id))
    write.rebuild(rds, job_id, [(first[0], evs[0])], 60)
    write.raise_fence(rds, job_id, 1, 60)
    write.append_fenced(rds, job_id, 1, evs[1:], 60, start=2)
    after = [p for i, p in write.entries(rds, job_id) if read._order(i) > read._order(client_saw)]
    assert after == evs[3:]  # what the reader had not seen yet, once
    assert [p for _, p in write.entries(rds, job_id)] == evs


def test_nothing_is_appended_after_a_terminal_event(rds):
    job_id = "job-pos-end-" + str(time.time_ns())
    write.raise_fence(rds, job_id, 1, 60)
    write.append_fenced(rds, job_id, 1, [encode(Delta(attempt=1, choice=0, text="a", token_ids=[1]))], 60, start=1)
    rds.xadd(keys.stream_key(job_id), {keys.FIELD: "{}"})  # a cancel's terminal event (time-based id)
    with pytest.raises(write.Fenced):
        write.append_fenced(rds, job_id, 1, [encode(Delta(attempt=1, choice=0, text="b", token_ids=[2]))], 60, start=2)


def test_a_group_is_fenced_together_and_each_attempt_keeps_its_own_outcome(
    session, sessions, rds, it_settings, engine_loop
):
    """A claimed group (one `run_jobs` message) is fenced in one script call and started on one
    thread before its attempts follow; each still ends on its own: a superseded one is lost and
    writes nothing, one that cannot resume exactly fails alone, and the others stream and succeed."""
    t = factories.tenant(session)
    fresh = [
        factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=8)) for _ in range(3)
    ]
    stale = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=8))
    write.raise_fence(rds, stale.id, 2, 60)  # attempt 2 owns its stream already
    cut = factories.job(session, t, state=JobState.dispatched, attempt=2, params=factories.params(max_tokens=8))
    for i in range(2):  # attempt 1 streamed two entries, and one was trimmed away: no exact resume
        rds.xadd(keys.stream_key(cut.id), {keys.FIELD: encode(Delta(attempt=1, choice=0, text="x", token_ids=[i]))})
    rds.xtrim(keys.stream_key(cut.id), maxlen=1, approximate=False)

    jobs = [*fresh, stale, cut]
    outcomes = JobRunner(engine_loop, it_settings, rds, sessions, "w-group").run_group(
        [(j.id, j.attempt) for j in jobs]
    )

    assert sorted(map(str, outcomes)) == sorted(["succeeded"] * 3 + ["lost", "failed"]), outcomes
    for j in fresh:
        row = session.get(Job, j.id, populate_existing=True)
        assert row.state == "succeeded" and row.usage["completion_tokens"] == 8
        assert int(rds.get(keys.fence_key(j.id))) == 1
        assert write.entries(rds, j.id)
    assert write.entries(rds, stale.id) == []
    assert int(rds.get(keys.fence_key(stale.id))) == 2  # raised together with the others, never lowered
    failed = session.get(Job, cut.id, populate_existing=True)
    assert failed.state == "failed" and failed.error["code"] == "resume_impossible"


def test_fences_raised_together_are_each_never_lowered(rds):
    a, b = "job-fences-a-" + str(time.time_ns()), "job-fences-b-" + str(time.time_ns())
    write.raise_fence(rds, b, 3, 60)
    assert write.raise_fences(rds, [(a, 1), (b, 2)], 60) == [1, 3]
    assert (int(rds.get(keys.fence_key(a))), int(rds.get(keys.fence_key(b)))) == (1, 3)
    assert 0 < rds.ttl(keys.fence_key(a)) <= 60
