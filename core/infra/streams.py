"""Per-job event streams in Redis: `job:{id}:events`, one JSON payload per entry.

A Redis stream (XADD with a cap and a TTL) rather than PUBLISH: a reader that attaches late, or
reconnects with `Last-Event-ID` (the stream entry id), replays exactly what it has not seen. This
module only moves payloads; what they mean is core/jobs/events.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from core.infra.kv import TRANSIENT

log = logging.getLogger(__name__)

FIELD = "e"


def stream_key(job_id: str) -> str:
    return f"job:{job_id}:events"


def cancel_key(job_id: str) -> str:
    """Set on cancel; the worker running the job polls it (~0.5 s) and drops the job."""
    return f"job:{job_id}:cancel"


def _text(v: Any) -> str:
    return v if isinstance(v, str) else v.decode()


def payload(fields: dict[Any, Any]) -> str:
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    return _text(raw)


def queue_append(pipe: Any, job_id: str, payloads: Iterable[str], ttl_s: int, maxlen: int) -> None:
    """Queue XADDs (and the TTL refresh) on a redis-py pipeline, sync or asyncio alike; the caller
    executes it, so one round trip carries a whole coalesced batch."""
    key = stream_key(job_id)
    for p in payloads:
        pipe.xadd(key, {FIELD: p}, maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)


def rebuild(redis: Any, job_id: str, logged: list[tuple[str, str]], ttl_s: int) -> None:
    """Write a lost stream again with its original entry ids, so a reader's Last-Event-ID still
    points into it and nothing is delivered twice."""
    key = stream_key(job_id)
    pipe = redis.pipeline(transaction=True)
    pipe.delete(key)
    for entry_id, p in logged:
        pipe.xadd(key, {FIELD: p}, id=entry_id)
    pipe.expire(key, ttl_s)
    pipe.execute()


def entries(redis: Any, job_id: str) -> list[tuple[str, str]]:
    """Every entry still in the stream (sync client): (entry id, payload)."""
    return [(_text(i), payload(f)) for i, f in redis.xrange(stream_key(job_id))]


async def read(redis: Any, job_id: str, last_id: str, block_ms: int) -> AsyncIterator[tuple[str, str] | None]:
    """(entry id, payload) after `last_id`, forever; None whenever `block_ms` passes in silence, or
    while Redis is unreachable (retried with a bounded backoff: the caller consults Postgres meanwhile)."""
    key = stream_key(job_id)
    backoff = 0.2
    while True:
        try:
            resp = await redis.xread({key: last_id}, block=block_ms, count=1000)
        except TRANSIENT:
            log.warning("redis unavailable while following %s; retrying in %.1fs", job_id, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            yield None
            continue
        backoff = 0.2
        if not resp:
            yield None
            continue
        for entry_id, fields in resp[0][1]:
            last_id = _text(entry_id)
            yield last_id, payload(fields)
