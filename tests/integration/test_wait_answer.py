"""A request that waits for its job (JSON, not streamed) is answered from the job's `Done` event when
the result is small: no statement is sent to Postgres after the job ends, and the answer is the one
the stored row renders. A result with scores is not carried: the ending is read back. Real Postgres,
Redis, the stream hub and a job runner with the paced engine, in-process."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis.asyncio as aioredis
from sqlalchemy import event
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from core.idempotency import Idempotency
from core.infra.orm import Job
from core.infra.streams import read
from core.jobs.service import Completions
from core.protocol import render
from core.states import JobState
from ops import factories
from tests.integration.conftest import IT_DB, IT_REDIS
from workers.engine.loop import EngineLoop
from workers.engine.paced import PacedEngine
from workers.outcome import Outcome
from workers.runner import JobRunner

MODEL = "smollm2-135m-instruct"


def _unsent(*_a, **_k):
    raise AssertionError("waiting sends nothing to the broker")


@pytest.mark.parametrize(("logprobs", "statements"), [(None, 0), (2, 1)])
def test_the_answer_comes_from_the_done_event_when_small(session, sessions, rds, it_settings, logprobs, statements):
    loop = EngineLoop(PacedEngine(MODEL, n_ctx=512, max_batch=4, step_ms=20.0, seq_ms=0.0))
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=6, logprobs=logprobs))
    runner = JobRunner(loop, it_settings, rds, sessions, "w-answer")
    out: list[Outcome] = []

    async def waited() -> tuple[Job | None, int]:
        engine = create_async_engine(IT_DB)
        sent: list[str] = []
        event.listen(engine.sync_engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
        aio = aioredis.Redis.from_url(IT_REDIS, decode_responses=True)
        hub = read.Hub(aio)
        service = Completions(
            async_sessionmaker(engine, expire_on_commit=False),
            aio,
            it_settings,
            Idempotency(async_sessionmaker(engine), 1.0),
            _unsent,
        )
        try:
            waiting = asyncio.ensure_future(service.wait(hub, job, t.id, 30.0))
            await asyncio.sleep(0.1)  # following the stream before the job starts: the live path
            th = threading.Thread(target=lambda: out.append(runner.run(job.id, 1)))
            th.start()
            got = await waiting
            th.join(10)
            return got, len(sent)
        finally:
            await hub.aclose()
            await aio.aclose()
            await engine.dispose()

    answered, sent = asyncio.run(waited())
    assert out == [Outcome.succeeded] and answered is not None
    assert sent == statements  # 0: answered from the event; 1: the ending read back (scores ride not)
    session.expire_all()
    stored = session.get(Job, job.id)
    assert stored is not None and stored.state == JobState.succeeded
    assert answered.state == "succeeded" and answered.usage == stored.usage and answered.result == stored.result
    fingerprint = "fp_test"
    assert render.response(answered, fingerprint) == render.response(stored, fingerprint)
