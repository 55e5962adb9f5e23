"""Issue 39: a worker cut from Postgres still takes job messages from Redis and cannot claim them. It
retried each claim for `infra_retry_s` (120 s), holding the message until the dispatcher's re-send
(60 s by default), which could land on the same cut-off worker again. Now it gives up the claim
after CLAIM_RETRY_S and pushes the message back onto the queue it came from, for a worker that can.
Real Redis as the broker; the Postgres is a real address nobody listens on."""

from __future__ import annotations

import time

import pytest
import redis as redis_lib
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from core.infra import broker, db
from workers.engine.loop import EngineLoop
from workers.engine.null import NullEngine
from workers.outcome import Outcome
from workers.runner import CLAIM_RETRY_S, JobRunner

# wallclock: waits out give-back windows (6 s of wall, 0.4 s of CPU in a shard)
# ops/test.sh runs it beside the CPU-bound shards.
pytestmark = pytest.mark.wallclock

MODEL = "give-back-model"


@pytest.fixture
def broker_redis(it_settings, monkeypatch):
    monkeypatch.setenv("SPOOL_REDIS_URL", it_settings.redis_url)
    from core.config import get_settings

    get_settings.cache_clear()
    broker.celery_app.cache_clear()
    broker._broker.cache_clear()
    rds = redis_lib.Redis.from_url(get_settings().celery_broker_url)
    for q in broker.queues_for(MODEL):
        rds.delete(q)
    yield rds
    for q in broker.queues_for(MODEL):
        rds.delete(q)
    rds.close()
    broker._broker.cache_clear()
    broker.celery_app.cache_clear()
    get_settings.cache_clear()


def test_a_claim_postgres_cannot_answer_ends_unclaimed_soon(rds, it_settings):
    away = create_engine(
        "postgresql+psycopg://postgres@127.0.0.1:1/spool", connect_args=db.connect_args(it_settings)
    )  # nothing listens on port 1: refused at once, as Postgres would be from a cut-off host
    loop = EngineLoop(NullEngine("smollm2-135m-instruct", n_ctx=512, max_batch=2))
    runner = JobRunner(loop, it_settings, rds, sessionmaker(bind=away), "cut-off:1")
    try:
        t0 = time.monotonic()
        assert runner.run("job-never-claimed", 1) == Outcome.unclaimed
        assert runner.run_group([("job-a", 1), ("job-b", 1)]) == [Outcome.unclaimed] * 2
        # Given up after its own short budget, not infra_retry_s (120 s by default).
        assert time.monotonic() - t0 < 2 * CLAIM_RETRY_S + 10 < it_settings.infra_retry_s
    finally:
        away.dispose()


def test_an_unclaimed_message_goes_back_to_the_queue_it_came_from(broker_redis):
    from workers import tasks

    queue = broker.queue_for(MODEL)
    assert tasks.give_back({"exchange": "", "routing_key": queue}, broker.RUN_JOB, ["job-1", 3])
    assert broker.queued_jobs(broker_redis, MODEL) == {("job-1", 3)}  # what the dispatcher's re-send check reads
    batch = broker.queue_for(MODEL, "batch")
    assert tasks.give_back({"routing_key": batch}, broker.RUN_JOBS, [[["line-1", 1], ["line-2", 1]]])
    assert broker.queued_jobs(broker_redis, MODEL) == {("job-1", 3), ("line-1", 1), ("line-2", 1)}
    assert not tasks.give_back({}, broker.RUN_JOB, ["job-2", 1])  # no queue named: the dispatcher re-sends it


def test_the_task_gives_back_what_its_runner_could_not_claim(broker_redis, rds, it_settings, monkeypatch):
    """The Celery task bodies, as a worker runs them: a real runner (null engine) whose Postgres is
    away, and the message's own delivery info naming its queue."""
    from workers import tasks

    away = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/spool", connect_args=db.connect_args(it_settings))
    loop = EngineLoop(NullEngine("smollm2-135m-instruct", n_ctx=512, max_batch=2))
    monkeypatch.setattr(tasks, "runner", lambda: JobRunner(loop, it_settings, rds, sessionmaker(bind=away), "cut:2"))
    queue, batch = broker.queue_for(MODEL), broker.queue_for(MODEL, "batch")
    try:
        tasks.run_job.push_request(delivery_info={"exchange": "", "routing_key": queue})
        try:
            assert tasks.run_job.run("job-task", 4) == Outcome.unclaimed
        finally:
            tasks.run_job.pop_request()
        tasks.run_jobs.push_request(delivery_info={"exchange": "", "routing_key": batch})
        try:
            assert tasks.run_jobs.run([["line-9", 1]]) == [Outcome.unclaimed]
        finally:
            tasks.run_jobs.pop_request()
        assert broker.queued_jobs(broker_redis, MODEL) == {("job-task", 4), ("line-9", 1)}
    finally:
        away.dispose()
