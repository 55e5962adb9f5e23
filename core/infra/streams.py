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


def fence_key(job_id: str) -> str:
    """The newest attempt that claimed the job: older attempts may no longer write its stream."""
    return f"job:{job_id}:fence"


def queue_append(pipe: Any, job_id: str, payloads: Iterable[str], ttl_s: int) -> None:
    """Queue XADDs (and the TTL refresh) on a redis-py pipeline, sync or asyncio alike; the caller
    executes it, so one round trip carries a whole coalesced batch. Streams are never trimmed: a
    resume replays the whole stream, and admission bounds a job's size; the TTL, refreshed on every
    append, removes them once the job has been quiet that long."""
    key = stream_key(job_id)
    for p in payloads:
        pipe.xadd(key, {FIELD: p})
    pipe.expire(key, ttl_s)


# Append only if no newer attempt has claimed the job (compare-and-append, atomic in Redis): a worker
# that lost its lease but still runs cannot interleave its tokens with its successor's.
_FENCED_APPEND = """
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
if fence > tonumber(ARGV[1]) then return false end
local ids = {}
for i = 3, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'e', ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return ids
"""

# Raise the fence to this attempt (never lower it); returns the fence now in force.
_RAISE_FENCE = """
local fence = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > fence then fence = tonumber(ARGV[1]) end
redis.call('SET', KEYS[1], fence, 'EX', ARGV[2])
return fence
"""


class Fenced(Exception):
    """A newer attempt owns the job's stream: this one must stop."""


def raise_fence(redis: Any, job_id: str, attempt: int, ttl_s: int) -> int:
    """Called by an attempt right after its claim, before it reads what earlier attempts streamed:
    anything a stale attempt appends later is refused, anything before is in what it reads."""
    return int(redis.eval(_RAISE_FENCE, 1, fence_key(job_id), attempt, ttl_s))


def append_fenced(redis: Any, job_id: str, attempt: int, payloads: list[str], ttl_s: int) -> list[str]:
    ids = redis.eval(_FENCED_APPEND, 2, stream_key(job_id), fence_key(job_id), attempt, ttl_s, *payloads)
    if ids is None:
        raise Fenced(f"job {job_id}: attempt {attempt} was superseded")
    return [_text(i) for i in ids]


def trimmed(redis: Any, job_id: str) -> bool:
    """Whether entries were ever removed from the stream (by hand, or by an older Spool's cap): a
    resume from it would be wrong. A missing stream is not trimmed (nothing to trust or distrust)."""
    try:
        info = redis.xinfo_stream(stream_key(job_id))
    except Exception:
        return False
    added = info.get("entries-added", info.get(b"entries-added"))
    return added is not None and int(added) != int(info.get("length", info.get(b"length", 0)))


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
