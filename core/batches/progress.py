"""Batches after validation: live counts, expiry, cancellation and the output/error files.

Driven by the dispatcher's tick. Every status change is a compare-and-set on the batch row, and
lines are jobs, so killing any process during a batch loses no line and runs none twice.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.batches.status import LIVE, BatchStatus, end, ending
from core.files import storage as files
from core.infra.orm import Batch, File, Job, JobState
from core.jobs.lifecycle import BATCH_CANCELLED, BATCH_EXPIRED, Lifecycle
from core.protocol import render

log = logging.getLogger(__name__)

ACTIVE = (JobState.queued.value, JobState.dispatched.value, JobState.running.value)
_WINDOW = re.compile(r"^(\d+)([smhd])$")


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def window_seconds(window: str) -> int | None:
    """OpenAI accepts "24h"; Spool also takes any "<n>s|m|h|d" (tests, short jobs)."""
    m = _WINDOW.match(window)
    if not m:
        return None
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _ts(d: datetime | None) -> int | None:
    return int(d.timestamp()) if d else None


def batch_json(b: Batch, counts: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": b.errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": _ts(b.created_at),
        "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at),
        "completed_at": _ts(b.completed_at),
        "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at),
        "cancelling_at": _ts(b.cancelling_at),
        "cancelled_at": _ts(b.cancelled_at),
        "request_counts": counts or b.request_counts,
        "metadata": b.meta,
    }


def state_counts(session: Any, batch_id: str):
    return select(Job.state, func.count()).where(Job.batch_id == batch_id).group_by(Job.state)


def summarize(rows: Iterable[Any]) -> tuple[dict[str, int], int]:
    """OpenAI's request_counts, and how many lines are still live."""
    by = dict(rows)
    total = sum(by.values())
    return (
        {
            "total": total,
            "completed": by.get("succeeded", 0),
            "failed": by.get("failed", 0) + by.get("cancelled", 0) + by.get("expired", 0),
        },
        sum(by.get(s, 0) for s in ACTIVE),
    )


def _line(job: Job) -> tuple[bool, dict[str, Any]]:
    """One output or error line in OpenAI's batch format; True when it belongs to the output file."""
    rid = "batch_req_" + job.id.removeprefix("cmpl-")
    if job.state == JobState.succeeded.value:
        body = render.response(job)
        return True, {
            "id": rid,
            "custom_id": job.custom_id,
            "response": {"status_code": 200, "request_id": job.id, "body": body},
            "error": None,
        }
    if job.state in (JobState.expired.value, JobState.cancelled.value):
        info = BATCH_EXPIRED if job.state == JobState.expired.value else BATCH_CANCELLED
        err = {"code": info.code, "message": info.message}
        return False, {"id": rid, "custom_id": job.custom_id, "response": None, "error": err}
    e = job.error or {"message": "The request failed.", "type": "server_error"}
    # A line refused by its tenant's limits (core/tenancy/admission.admit_lines) is a 429, as it would be alone.
    status = {"invalid_request_error": 400, "tokens": 429, "requests": 429}.get(e.get("type") or "", 500)
    body = {
        "error": {"message": e.get("message"), "type": e.get("type"), "param": e.get("param"), "code": e.get("code")}
    }
    return False, {
        "id": rid,
        "custom_id": job.custom_id,
        "response": {"status_code": status, "request_id": job.id, "body": body},
        "error": None,
    }


def write_results(session: Session, b: Batch) -> None:
    """Stream the batch's lines, in input order, into an output and an error file."""
    out, err = (
        File(
            id=files.new_file_id(),
            tenant_id=b.tenant_id,
            purpose="batch_output",
            filename=f"{b.id}_{kind}.jsonl",
            bytes=0,
            lines=0,
            status="processed",
        )
        for kind in ("output", "error")
    )
    session.add_all([out, err])
    session.flush()
    writers = {True: files.ChunkWriter(session, out), False: files.ChunkWriter(session, err)}
    stmt = select(Job).where(Job.batch_id == b.id).order_by(Job.line_no).execution_options(yield_per=1000)
    for job in session.scalars(stmt):
        ok, line = _line(job)
        writers[ok].write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        (out if ok else err).lines += 1
        session.expunge(job)
    for w in writers.values():
        w.close()
    b.output_file_id = out.id if out.lines else None
    b.error_file_id = err.id if err.lines else None


# Lines one pass expires or cancels per batch, each pass its own transaction: a 2M-line batch whose
# window ends is worked through over several passes instead of one statement holding every row.
SLICE = 5000


def advance(session: Session, lifecycle: Lifecycle, limit: int = 20, slice_rows: int = SLICE) -> int:
    """Move live batches along: counts, expiry, cancellation, finalization. Returns how many ended.

    A batch's queued lines end (expired or cancelled) through the job lifecycle like every job: the
    state change and one usage count per line in this pass's transaction, then, once it committed,
    each line's reservation settled and its terminal event published."""
    ended = 0
    lines: list[tuple[list[Any], JobState]] = []
    rows = session.scalars(
        select(Batch)
        .where(Batch.status.in_([s.value for s in LIVE]))
        .order_by(Batch.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    now = datetime.now(UTC)
    for b in rows:
        if b.status == BatchStatus.in_progress and b.expires_at <= now and b.expired_at is None:
            b.expired_at = now  # lines not started are done for; running ones may finish
        to = None
        if b.status == BatchStatus.in_progress and b.expired_at is not None:
            to = JobState.expired
        if b.status == BatchStatus.cancelling:
            to = JobState.cancelled
        if to is not None:
            rows = lifecycle.end_queued_lines(session, b.id, to, slice_rows)
            lines.append((rows, to))
            if len(rows) >= slice_rows:  # the rest in the next passes; counting and finalizing wait until then
                continue
        counts, live = summarize(session.execute(state_counts(session, b.id)).all())
        b.request_counts = counts
        if live:
            continue
        final = ending(b)
        write_results(session, b)
        end(b, final, now)
        ended += 1
        log.info("batch %s %s: %s", b.id, final, counts)
    session.commit()
    for rows, to in lines:
        lifecycle.announce_lines(rows, to)
    return ended


def expires_at(created: datetime, window: str) -> datetime:
    return created + timedelta(seconds=window_seconds(window) or 86400)
