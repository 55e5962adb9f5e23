"""Issue 49: every ended job, a batch line that never ran included, left its marks in Redis for a day
and a one-entry terminal stream (~4.8 KB: Redis preallocates a stream's first listpack) for minutes,
counted against no tenant. A job that never ran now leaves nothing there (its row answers its
readers); what a job that streamed leaves lives as long as its ended stream (its marks are on its
row), and its bytes count to its tenant (`core/tenancy/usage.py`). Real Postgres and Redis, in-process."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.generation.events import Cancelled, ChoiceResult, Delta, ErrorInfo, Failed, JobResult, Usage
from core.infra import kv
from core.infra.orm import Job
from core.infra.streams import keys, read, write
from core.jobs import transitions
from core.jobs.follow import HEARTBEAT, follow_grouped
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from core.tenancy import usage
from ops import factories
from tests.integration.conftest import IT_REDIS

ERR = ErrorInfo(message="over", type="tokens", code="rate_limit_exceeded")


def _left(rds, job_id: str) -> list[bytes]:
    return sorted(rds.scan_iter(match=f"*{job_id}*", count=1000))


def _cancel_queued(lc: Lifecycle, session, t) -> Job:
    j = factories.job(session, t)
    assert lc.cancel(j.id, t.id) is not None
    return j


def _fail_at_dispatch(lc: Lifecycle, session, t) -> Job:
    """The dispatcher's batch line over its tenant's daily tokens (`fail_queued`)."""
    j = factories.job(session, t)
    assert lc.fail_queued(j.id, 1, ERR)
    return j


def _fail_before_any_token(lc: Lifecycle, session, t) -> Job:
    """Claimed by a worker (its fence raised), failed before it streamed anything."""
    j = factories.job(session, t, state=JobState.running, lease_s=60)
    write.raise_fence(lc.redis, j.id, 1, 86400)
    assert lc.fail(j, ERR)
    return j


@pytest.mark.parametrize("end", [_cancel_queued, _fail_at_dispatch, _fail_before_any_token])
def test_a_job_that_never_ran_leaves_nothing_in_redis(session, sessions, rds, it_settings, end):
    t = factories.tenant(session)
    lc = Lifecycle(sessions, rds, it_settings)
    j = end(lc, session, t)
    session.expire_all()
    assert session.get(Job, j.id).state in (JobState.cancelled.value, JobState.failed.value)
    # The old code left `job:<id>:events` (5 min) and `job:<id>:marks` (a day) behind for each.
    # A claimed job's fence alone stays, as briefly as an ended stream would.
    left = _left(rds, j.id)
    assert left in ([], [keys.fence_key(j.id).encode()]), left
    if left:
        assert 0 < rds.ttl(left[0]) <= it_settings.ended_events_ttl_s
    assert usage.redis_bytes(rds, it_settings.ended_events_ttl_s).get(t.id, 0) == 0


def _streamed_and_succeeded(lc: Lifecycle, session, t, words: list[str]) -> Job:
    """A job as a worker runs it: claimed (fence), its deltas by the fenced append, then `succeed`."""
    j = factories.job(session, t, state=JobState.running, lease_s=60)
    write.raise_fence(lc.redis, j.id, 1, lc.settings.events_ttl_s)
    deltas = [
        Delta(attempt=1, choice=0, text=w, token_ids=[i], finish_reason="stop" if i == len(words) - 1 else None)
        for i, w in enumerate(words)
    ]
    lc.publish_deltas(j.id, 1, deltas, start=1)
    result = JobResult(choices=[ChoiceResult(index=0, text="".join(words), finish_reason="stop")])
    assert lc.succeed(j, result, Usage(prompt_tokens=3, completion_tokens=len(words)), 0.01)
    return j


def test_a_streamed_jobs_keys_live_as_long_as_its_stream_and_count_to_its_tenant(session, sessions, rds, it_settings):
    ttl = it_settings.ended_events_ttl_s
    t, other = factories.tenant(session), factories.tenant(session)
    lc = Lifecycle(sessions, rds, it_settings)
    j = _streamed_and_succeeded(lc, session, t, [" one", " two", " three"])
    kept = [keys.stream_key(j.id), keys.fence_key(j.id)]
    # The marks were kept a day, then as long as the stream: now on the job's row, nothing in Redis.
    assert _left(rds, j.id) == sorted(k.encode() for k in kept)
    for k in kept:  # the fence was kept a day too
        assert 0 < rds.ttl(k) <= ttl, k
    session.expire_all()
    marks = session.get(Job, j.id).marks
    assert [(m[0], m[2], m[5]) for m in read.parse_marks(marks)] == [(1, 4, False), (2, 4, False), (3, 6, True)]

    held = sum(int(rds.memory_usage(k)) for k in kept)
    counted = usage.redis_bytes(rds, ttl)
    assert counted[t.id] == held and held > 4096  # the stream's first listpack is most of it
    assert other.id not in counted

    # An end sent again (its answer lost on the way) counts nothing twice.
    pipe = rds.pipeline(transaction=False)
    write.queue_end(pipe, j.id, t.id, ['{"type":"done"}'], ttl)
    pipe.execute()
    assert usage.redis_bytes(rds, ttl)[t.id] == held

    # Per tenant: the other tenant's job is counted to it alone.
    j2 = _streamed_and_succeeded(lc, session, other, [" x"])
    counted = usage.redis_bytes(rds, ttl)
    assert counted[t.id] == held and counted[other.id] > 0
    assert asyncio.run(_one(other.id, ttl)) == counted[other.id]
    rds.delete(*kept, keys.stream_key(j2.id), keys.fence_key(j2.id))


async def _one(tenant_id: int, ttl: int) -> int:
    a = kv.async_client(IT_REDIS)
    try:
        return await usage.tenant_redis_bytes(a, ttl, tenant_id)
    finally:
        await a.aclose()


def test_a_reader_of_an_ended_job_without_a_stream_hears_its_row_at_once(session, sessions, rds, it_settings):
    """What an SSE client that asks for a job cancelled while queued gets now that no stream exists:
    the row's ending, without waiting out a silence first (`block_ms` here is 10 s)."""
    t = factories.tenant(session)
    lc = Lifecycle(sessions, rds, it_settings)
    j = _cancel_queued(lc, session, t)
    assert not rds.exists(keys.stream_key(j.id))
    session.expire_all()
    row = session.get(Job, j.id)
    assert transitions.is_terminal(row.state)

    async def check():
        return row

    async def follow_it() -> tuple[list, float]:
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=10_000)
        started = time.monotonic()
        try:
            got = [b async for b in follow_grouped(hub, j.id, check, block_ms=10_000, ended=True)]
            return got, time.monotonic() - started
        finally:
            await hub.aclose()

    groups, took = asyncio.run(follow_it())
    evs = [ev for b in groups if b is not HEARTBEAT for _, ev in b]
    assert len(evs) == 1 and isinstance(evs[0], (Cancelled, Failed)), evs
    assert took < 5, took
