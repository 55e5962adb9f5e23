"""The Redis keys of a job's event stream (`job:{id}:events`) and of its cancel flag, fence and old
marks, and how an entry holds its payload: what the write side (write.py) and the read side
(read.py) share. Every key of the stream is spelled here, once.
"""

from __future__ import annotations

from typing import Any

FIELD = "e"


def stream_key(job_id: str) -> str:
    return f"job:{job_id}:events"


def cancel_key(job_id: str) -> str:
    """Set on cancel; the worker running the job polls it (~0.5 s) and drops the job."""
    return f"job:{job_id}:cancel"


def text(v: Any) -> str:
    return v if isinstance(v, str) else v.decode()


def payload(fields: dict[Any, Any]) -> str:
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    return text(raw)


def marks_key(job_id: str) -> str:
    """Where Spool once kept an ended job's marks in Redis (they are on its row now, `write.marks_of`):
    read only as a fallback, for a job ended before that; nothing writes it any more."""
    return f"job:{job_id}:marks"


def fence_key(job_id: str) -> str:
    """The newest attempt that claimed the job: older attempts may no longer write its stream."""
    return f"job:{job_id}:fence"
