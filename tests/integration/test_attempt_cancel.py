"""A running attempt stops when its job is cancelled: the cancel (Postgres, then the job's cancel key
in Redis) is seen by the worker's cancel watch (workers/cancels.py), the attempt drops its sequences
and the engine stops generating. Real Postgres and Redis, in-process; the paced engine, slowed."""

from __future__ import annotations

import threading
import time

import pytest

from core.infra.streams import write
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from ops import factories
from workers.engine.loop import EngineLoop
from workers.engine.paced import PacedEngine
from workers.outcome import Outcome
from workers.runner import JobRunner

# wallclock: waits for a cancel to be heard (8 s of wall, 1 s of CPU in a shard)
# ops/test.sh runs it beside the CPU-bound shards.
pytestmark = pytest.mark.wallclock

MODEL = "smollm2-135m-instruct"


def test_a_cancelled_job_stops_its_running_attempt(session, sessions, rds, it_settings):
    # One token every 3 s: the cancel lands between two appends, so it is the watch that stops the
    # attempt (an append after the cancel's terminal event would stop it too, as Fenced: "lost").
    loop = EngineLoop(PacedEngine(MODEL, n_ctx=512, max_batch=4, step_ms=3000.0, seq_ms=0.0))
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=400))
    runner = JobRunner(loop, it_settings, rds, sessions, "w-cancel")
    out: list[Outcome] = []
    th = threading.Thread(target=lambda: out.append(runner.run(job.id, 1)))
    th.start()
    deadline = time.monotonic() + 20
    while not write.entries(rds, job.id):  # its first token is out
        assert time.monotonic() < deadline, "the attempt never streamed"
        time.sleep(0.05)
    assert Lifecycle(sessions, rds, it_settings).cancel(job.id, t.id) is not None
    th.join(10)
    assert not th.is_alive(), "the attempt did not stop after its job was cancelled"
    assert out == [Outcome.cancelled]
    asked = time.monotonic()
    while loop.live_count():  # its sequences are dropped from the engine (through the loop's inbox)
        assert time.monotonic() - asked < 10, "the cancelled job's sequence stayed in the engine"
        time.sleep(0.05)
    assert runner.cancels.watching() == 0  # the ended attempt is no longer asked about


def test_attempts_that_end_leave_nothing_watched(session, sessions, rds, it_settings):
    """Every attempt stops being asked about when it ends: a watch left behind would be asked every
    0.25-0.5 s for ever (seen: 15 EXISTS per short job, growing with every job the worker ran)."""
    loop = EngineLoop(PacedEngine(MODEL, n_ctx=512, max_batch=4, step_ms=1.0, seq_ms=0.0))
    t = factories.tenant(session)
    runner = JobRunner(loop, it_settings, rds, sessions, "w-ends")
    for _ in range(3):
        job = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=4))
        assert runner.run(job.id, 1) == Outcome.succeeded
        assert runner.cancels.watching() == 0
