"""SSE framing of a job's chunks: the protocol renders chunk objects, this module frames them."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from fastapi.sse import format_sse_event
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from api.cache import SingleFlight
from core.generation.events import TerminalRow
from core.infra import redis_keys, streams
from core.infra.db import async_sessions
from core.jobs import transitions
from core.jobs.stream import HEARTBEAT, coalesce, follow_batches
from core.protocol.render import JobRecord, chunks_for


def sse(data: dict[str, Any] | str, event_id: str | None = None) -> bytes:
    raw = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return format_sse_event(data_str=raw, id=event_id)


def sse_comment(text: str) -> bytes:
    """A comment line alone, with no blank line after it. The blank line that ends an event block
    makes some decoders dispatch an event even when the block held only a comment: the openai SDK's
    keeps the last `id:` across events, emits an event with empty data and fails to parse it as JSON.
    A comment line is all a proxy needs to keep the connection open (WHATWG SSE: lines starting with
    ':' are ignored, and the next event's fields simply follow it)."""
    return b": " + text.encode() + b"\n"


_TERMINAL: SingleFlight[TerminalRow | None] = SingleFlight(ttl_s=1.0)


def terminal_row_check(job_id: str, tenant_id: int):
    """Asked when the stream is silent: the job's row if it has ended (its stream may be gone)."""

    async def load() -> TerminalRow | None:
        async with async_sessions()() as session:
            row = (await session.execute(transitions.get_for_tenant(job_id, tenant_id))).scalar()
        return row if row is not None and transitions.is_terminal(row.state) else None

    async def check() -> TerminalRow | None:
        try:  # every reader of a job that falls silent at once shares one query
            return await _TERMINAL.get((job_id, tenant_id), load)
        except (OperationalError, InterfaceError, PoolTimeout):
            return None  # Postgres is restarting or busy: the stream goes on; we ask again at the next silence

    return check


async def readers(rds: aioredis.Redis, job_id: str) -> int:
    """How many SSE streams follow this job right now (on any API replica)."""
    return int(await rds.get(redis_keys.readers(job_id)) or 0)


async def sse_chunks(
    job: JobRecord,
    tenant_id: int,
    rds: aioredis.Redis,
    reader: streams.Reader,
    *,
    include_usage: bool,
    fingerprint: str,
    last_id: str = "0-0",
) -> AsyncIterator[bytes]:
    """A job's events as OpenAI completion chunks (SSE bytes), with keep-alive comments while the
    stream is silent; ends after the terminal event."""
    chunks = chunks_for(job, include_usage, fingerprint)
    # This reader is counted while it follows the job (a disconnected stream's job is cancelled only
    # when nobody follows it). The count goes up and back down in tasks of their own: a stream
    # cancelled at any moment, even while its increment is in flight, still takes back exactly what
    # it added, so a client that hangs up at once does not leave a phantom reader behind.
    counted = asyncio.ensure_future(_count_reader(rds, job.id))
    try:
        await asyncio.shield(counted)
        check = terminal_row_check(job.id, tenant_id)
        async with contextlib.aclosing(follow_batches(reader, job.id, check, last_id=last_id)) as batches:
            async for batch in batches:
                if batch is HEARTBEAT:
                    yield sse_comment("keep-alive")
                    continue
                # Everything that arrived while this client was being written to goes out in one
                # write, each run of one choice's tokens as one chunk (core/jobs/stream.coalesce).
                out = bytearray()
                for entry_id, ev in coalesce(batch):  # type: ignore[arg-type]
                    for chunk in chunks.render(ev):
                        out += sse(chunk, entry_id if isinstance(chunk, dict) else None)
                if out:
                    yield bytes(out)
    finally:
        task = asyncio.get_running_loop().create_task(_uncount_reader(rds, job.id, counted))
        _UNCOUNTING.add(task)
        task.add_done_callback(_UNCOUNTING.discard)


_UNCOUNTING: set[asyncio.Task] = set()


async def _count_reader(rds: aioredis.Redis, job_id: str) -> bool:
    try:
        pipe = rds.pipeline(transaction=False)
        pipe.incr(redis_keys.readers(job_id))
        pipe.expire(redis_keys.readers(job_id), 3600)
        await pipe.execute()
        return True
    except Exception:  # counting readers is best effort: a Redis outage must not end the stream
        return False


async def _uncount_reader(rds: aioredis.Redis, job_id: str, counted: asyncio.Future[bool]) -> None:
    with contextlib.suppress(Exception):
        if await counted:
            await rds.decr(redis_keys.readers(job_id))
