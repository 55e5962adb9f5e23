"""Following a job's event stream (Redis) until its end, answered by Postgres when it is gone."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from core.infra import streams
from core.jobs.events import Event, TerminalRow, decode, from_row, is_terminal

RowCheck = Callable[[], Awaitable[TerminalRow | None]]
HEARTBEAT = object()


async def follow(
    redis: Any, job_id: str, check_row: RowCheck, last_id: str = "0-0", block_ms: int = 2000
) -> AsyncIterator[tuple[str | None, Event] | object]:
    """Yield (entry id, event) from `last_id` on until a terminal event. When the stream is silent,
    yield HEARTBEAT and consult Postgres, which answers if the stream expired or was never written
    (a job that failed before its worker started, say)."""
    async for item in streams.read(redis, job_id, last_id, block_ms):
        if item is None:
            row = await check_row()
            if row is not None:
                for ev in from_row(row):
                    yield None, ev
                return
            yield HEARTBEAT
            continue
        entry_id, raw = item
        ev = decode(raw)
        yield entry_id, ev
        if is_terminal(ev):
            return
