"""Per-job event streams in Redis: `job:{id}:events`.

A Redis stream (XADD with a cap and a TTL) rather than PUBLISH: a reader that attaches late, or
reconnects with `Last-Event-ID` (the stream entry id), replays exactly what it has not seen.

Event payloads (one JSON field `e` per entry):
  {"type": "delta", "attempt", "choice", "text", "token_ids", "finish_reason", "t"}
  {"type": "done", "attempt", "usage", "t"}            terminal: the job succeeded
  {"type": "error", "attempt", "error", "t"}           terminal: the job failed
  {"type": "cancelled", "t"}                           terminal: the job was cancelled
"""

from __future__ import annotations

import json
import time
from typing import Any

TERMINAL_TYPES = frozenset({"done", "error", "cancelled"})
FIELD = "e"


def stream_key(job_id: str) -> str:
    return f"job:{job_id}:events"


def cancel_key(job_id: str) -> str:
    """Set by the API on cancel; the worker running the job polls it (~0.5 s) and drops it."""
    return f"job:{job_id}:cancel"


def encode(event: dict[str, Any]) -> dict[str, str]:
    event.setdefault("t", time.time())
    return {FIELD: json.dumps(event, separators=(",", ":"))}


def decode(fields: dict[Any, Any]) -> dict[str, Any]:
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    return json.loads(raw)


def queue_append(pipe: Any, job_id: str, events: list[dict[str, Any]], ttl_s: int, maxlen: int) -> None:
    """Queue XADDs (and the TTL refresh) on a redis-py pipeline, sync or asyncio alike; the caller
    executes it, so one round trip carries a whole coalesced batch."""
    key = stream_key(job_id)
    for ev in events:
        pipe.xadd(key, encode(ev), maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)


def is_terminal(event: dict[str, Any]) -> bool:
    return event.get("type") in TERMINAL_TYPES
