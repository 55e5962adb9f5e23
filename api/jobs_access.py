"""Job reads and cancellation shared by the routes."""

from __future__ import annotations

import redis.asyncio as aioredis
from sqlalchemy.ext.asyncio import AsyncSession

from api.streaming import HEARTBEAT, ChunkWriter, follow, sse_comment
from core import events, jobs, ratelimit, usage
from core.db import async_sessions
from core.models import Job
from core.settings import get_settings


def terminal_row_check(job_id: str, tenant_id: int):
    async def check() -> Job | None:
        async with async_sessions()() as session:
            row = (await session.execute(jobs.get_for_tenant(job_id, tenant_id))).scalar()
        return row if row is not None and jobs.is_terminal(row.state) else None

    return check


async def cancel_job(session: AsyncSession, rds: aioredis.Redis, job_id: str, tenant_id: int) -> Job | None:
    """Cancel if live; returns the job row either way (None if it is not this tenant's)."""
    s = get_settings()
    row = (await session.execute(jobs.cancel(job_id, tenant_id))).scalar()
    if row is not None:
        await session.execute(
            usage.record(tenant_id=row.tenant_id, key_id=row.key_id, model=row.model, outcome="cancelled")
        )
    await session.commit()
    if row is not None:
        await ratelimit.settle_async(rds, job_id, 0)  # a cancelled job gives its reservation back
        pipe = rds.pipeline(transaction=False)
        pipe.set(events.cancel_key(job_id), 1, ex=3600)
        events.queue_append(pipe, job_id, [{"type": "cancelled"}], s.events_ttl_s, s.events_maxlen)
        await pipe.execute()
        return row
    return (await session.execute(jobs.get_for_tenant(job_id, tenant_id))).scalar()


async def sse_chunks(job: Job, tenant_id: int, rds: aioredis.Redis, *, include_usage: bool, last_id: str = "0-0"):
    """A job's events as OpenAI completion chunks (SSE bytes), with keep-alive comments while the
    stream is silent; ends after the terminal event."""
    writer = ChunkWriter(job, include_usage)
    async for item in follow(rds, job.id, terminal_row_check(job.id, tenant_id), last_id=last_id):
        if item is HEARTBEAT:
            yield sse_comment("keep-alive")
            continue
        entry_id, ev = item
        for chunk in writer.render(entry_id, ev):
            yield chunk
