"""Batches after validation: expiry, cancellation, finalization and the output/error files.

Driven by the dispatcher's batch keeper, one transaction per batch per pass, each pass bounded to a
slice of lines. Counts are not recounted here: a trigger on jobs keeps them as lines end. Every
status change is a compare-and-set on the batch row, and lines are jobs, so killing any process
during a batch loses no line and runs none twice.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session, sessionmaker

from core.batches.status import FINAL, LIVE, BatchStatus, end, ending, finalizing
from core.files import storage as files
from core.infra.orm import Batch, File, Job
from core.jobs.lifecycle import BATCH_CANCELLED, BATCH_EXPIRED, Lifecycle
from core.jobs.states import JobState
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


def counts(b: Batch) -> dict[str, int]:
    """OpenAI's request_counts: the total from validation, the rest as kept by the trigger on jobs."""
    total = int((b.request_counts or {}).get("total", 0))
    return {"total": total, "completed": b.lines_completed or 0, "failed": b.lines_failed or 0}


def batch_json(b: Batch) -> dict[str, Any]:
    """The batch object: result files being written are not shown until they are whole."""
    return render.batch(b, counts(b), files_shown=b.status in FINAL)


# Postgres notifies this channel when a batch's last live line ends (migration 0011's trigger).
LINES_ENDED = "spool_batch_lines_ended"


def has_live_lines(batch_id: str):
    """One probe of ix_jobs_batch_state per live state: cheap however many lines the batch has."""
    return select(exists().where(Job.batch_id == batch_id, Job.state.in_(ACTIVE)))


def _line(job: Job, fingerprints: render.Fingerprints) -> tuple[bool, dict[str, Any]]:
    """One output or error line in OpenAI's batch format; True when it belongs to the output file."""
    rid = "batch_req_" + job.id.removeprefix("cmpl-")
    if job.state == JobState.succeeded.value:
        body = render.response(job, fingerprints(job.model))
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


def _result_file(b: Batch, kind: str) -> File:
    """An output or error file being written: hidden (like an upload in progress) until the batch ends."""
    return File(
        id=files.new_file_id(),
        tenant_id=b.tenant_id,
        purpose="batch_output",
        filename=f"{b.id}_{kind}.jsonl",
        bytes=0,
        lines=0,
        status="processing",
        deleted=True,
    )


def write_results(session: Session, b: Batch, slice_rows: int, fingerprints: render.Fingerprints) -> bool:
    """Up to `slice_rows` more of the batch's lines, in input order, into its output and error files,
    from where the last pass stopped (`results_line`). True once every line is written."""
    if b.results_line is None:
        out, err = _result_file(b, "output"), _result_file(b, "error")
        session.add_all([out, err])
        session.flush()
        b.output_file_id, b.error_file_id, b.results_line = out.id, err.id, 0
    else:
        out, err = (session.get_one(File, fid) for fid in (b.output_file_id, b.error_file_id))
    writers = {
        ok: files.ChunkWriter(session, f, files.next_seq(session, f.id)) for ok, f in ((True, out), (False, err))
    }
    stmt = (
        select(Job)
        .where(Job.batch_id == b.id, Job.line_no > b.results_line)
        .order_by(Job.line_no)
        .limit(slice_rows)
        .execution_options(yield_per=1000)
    )
    n = 0
    for job in session.scalars(stmt):
        ok, line = _line(job, fingerprints)
        writers[ok].write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        (out if ok else err).lines += 1
        b.results_line = job.line_no
        n += 1
        session.expunge(job)
    for w in writers.values():
        w.close()
    if n >= slice_rows:
        return False
    for f in (out, err):
        if f.lines:
            f.status, f.deleted = "processed", False
        else:
            session.delete(f)
    b.output_file_id = out.id if out.lines else None
    b.error_file_id = err.id if err.lines else None
    return True


# Lines one pass expires, cancels or writes out per batch, each pass its own transaction: a 2M-line
# batch whose window ends is worked through over several passes instead of one statement holding
# every row, and the keeper comes back at once while a batch has more to do.
SLICE = 5000


@dataclass
class Pass:
    ended: int = 0  # batches that reached their final status
    more: bool = False  # some batch stopped at a full slice: call again without waiting


def advance(sessions: sessionmaker[Session], lifecycle: Lifecycle, limit: int = 20, slice_rows: int = SLICE) -> Pass:
    """Move live batches along: expiry, cancellation, finalization; one transaction per batch.

    A batch's queued lines end (expired or cancelled) through the job lifecycle like every job: the
    state change and one usage count per line in the batch's transaction, then, once it committed,
    each line's reservation settled and its terminal event published. Counts need no work here:
    a trigger on jobs keeps them as lines end."""
    done = Pass()
    fingerprints = render.Fingerprints(lifecycle.settings)  # of the lines written out this pass
    with sessions() as session:
        ids = session.scalars(
            select(Batch.id).where(Batch.status.in_([s.value for s in LIVE])).order_by(Batch.created_at).limit(limit)
        ).all()
    for batch_id in ids:
        with sessions() as session:
            b = session.scalars(
                select(Batch)
                .where(Batch.id == batch_id, Batch.status.in_([s.value for s in LIVE]))
                .with_for_update(skip_locked=True)
            ).first()
            if b is None:  # ended meanwhile, or another keeper holds it
                continue
            try:
                ended, more, lines = _step(session, lifecycle, b, slice_rows, fingerprints)
                session.commit()
            except Exception:  # this batch's pass is rolled back whole; the others go on
                log.exception("batch %s: bookkeeping pass failed; retried on the next pass", batch_id)
                session.rollback()
                continue
        if lines is not None:
            lifecycle.announce_lines(*lines)
        done.ended += ended
        done.more |= more
    return done


def _step(
    session: Session, lifecycle: Lifecycle, b: Batch, slice_rows: int, fingerprints: render.Fingerprints
) -> tuple[int, bool, tuple[list[Any], JobState] | None]:
    """One batch's share of a pass: (ended, more to do, lines ended to announce after the commit)."""
    now = datetime.now(UTC)
    lines = None
    if b.status == BatchStatus.in_progress and b.expires_at <= now and b.expired_at is None:
        b.expired_at = now  # lines not started are done for; running ones may finish
    to = None
    if b.status == BatchStatus.in_progress and b.expired_at is not None:
        to = JobState.expired
    if b.status == BatchStatus.cancelling:
        to = JobState.cancelled
    if to is not None:
        rows = lifecycle.end_queued_lines(session, b.id, to, slice_rows)
        lines = (rows, to)
        if len(rows) >= slice_rows:  # the rest in the next passes; finalizing waits until then
            return 0, True, lines
    if b.status != BatchStatus.finalizing:
        if session.scalar(has_live_lines(b.id)):
            return 0, False, lines
        finalizing(b, now)
    if not write_results(session, b, slice_rows, fingerprints):
        return 0, True, lines
    session.flush()
    session.refresh(b, ["lines_completed", "lines_failed"])  # the trigger's counts, this transaction's included
    end(b, ending(b), now)
    log.info("batch %s %s: %s", b.id, b.status, counts(b))
    return 1, False, lines


def expires_at(created: datetime, window: str) -> datetime:
    return created + timedelta(seconds=window_seconds(window) or 86400)
