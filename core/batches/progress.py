"""Batches after validation: expiry, cancellation, finalization and the output/error files.

Driven by the dispatcher's batch keeper, one transaction per batch per pass, each pass bounded to a
slice of lines per tenant. Every live batch is looked at, fairly across tenants: each pass takes up
to `PER_TENANT` batches of every tenant that has live ones (those that need the keeper first, then
in turn from where that tenant's last pass stopped), interleaved tenant by tenant, and one tenant's
batches share one slice of lines a pass (no oldest-first pass with a fixed limit, where one
tenant's twenty live batches hid every younger batch of everyone). Counts are not recounted here:
a trigger on jobs keeps them as lines end. Every status change is a compare-and-set on the batch
row, and lines are jobs, so killing any process during a batch loses no line and runs none twice.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, Exists, Text, and_, bindparam, case, cast, exists, func, or_, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, sessionmaker

from core.batches.transitions import LIVE, end, ending, finalizing
from core.files import expiry
from core.files import storage as files
from core.generation.events import Usage
from core.infra.orm import Batch, File, Job
from core.jobs.lifecycle import LINE_ENDINGS, Lifecycle
from core.protocol import render
from core.states import FINAL, BatchStatus, Ending, FileStatus, JobState

log = logging.getLogger(__name__)

ACTIVE = (JobState.queued.value, JobState.dispatched.value, JobState.running.value)
_WINDOW = re.compile(r"^([0-9]{1,15})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# The longest completion_window a batch may ask for ("30d", "720h", ...): a 400 past it. OpenAI
# takes only "24h"; Spool takes any "<n>s|m|h|d" from 1 s up to this.
MAX_WINDOW_S = 30 * 86400
MAX_WINDOW_CHARS = 16  # the column's width


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def window_seconds(window: str) -> int | None:
    """OpenAI accepts "24h"; Spool also takes any "<n>s|m|h|d" (tests, short jobs). None: not a
    duration (past 15 digits is not one either). Bounds are `window_problem`'s."""
    m = _WINDOW.match(window)
    if not m:
        return None
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def window_problem(window: str) -> str | None:
    """Why a client's completion_window is refused (a 400 naming it), or None."""
    secs = window_seconds(window) if len(window) <= MAX_WINDOW_CHARS else None
    if secs is None:
        return "completion_window must be '24h' (or a duration like '30m', '2h', '7d')."
    if secs < 1 or secs > MAX_WINDOW_S:
        return f"completion_window must be between 1s and {MAX_WINDOW_S // 86400}d; got '{window}'."
    return None


def counts(b: Batch) -> dict[str, int]:
    """OpenAI's request_counts: the total from validation, the rest as kept by the trigger on jobs."""
    total = int((b.request_counts or {}).get("total", 0))
    return {"total": total, "completed": b.lines_completed or 0, "failed": b.lines_failed or 0}


def usage(b: Batch) -> Usage:
    """What its ended lines used, as kept on the row by the trigger on jobs (migration 0017)."""
    return Usage(
        prompt_tokens=b.usage_prompt_tokens or 0,
        completion_tokens=b.usage_completion_tokens or 0,
        cached_tokens=b.usage_cached_tokens or 0,
    )


def batch_json(b: Batch) -> dict[str, Any]:
    """The batch object: result files being written are not shown until they are whole."""
    return render.batch(b, counts(b), usage(b), files_shown=b.status in FINAL)


# Postgres notifies this channel when a batch's last live line ends (migration 0011's trigger).
LINES_ENDED = "spool_batch_lines_ended"


def has_live_lines(batch_id: str):
    """One probe of ix_jobs_batch_state per live state: cheap however many lines the batch has."""
    return select(exists().where(Job.batch_id == batch_id, Job.state.in_(ACTIVE)))


def _line(job: Job, fingerprints: render.Fingerprints) -> tuple[bool, dict[str, Any]]:
    """One output or error line (built by core/protocol/render.py); True when it belongs to the output file."""
    if job.state == JobState.succeeded.value:
        return True, render.batch_answered_line(
            job.id, job.custom_id, 200, render.batch_body(job, fingerprints(job.model))
        )
    if job.state in LINE_ENDINGS:
        info = LINE_ENDINGS[Ending(job.state)]
        return False, render.batch_unrun_line(job.id, job.custom_id, info.code, info.message)
    e = job.error or {"message": "The request failed.", "type": "server_error"}
    # A line refused by its tenant's limits (core/tenancy/admission.admit_lines) is a 429, as it would be alone.
    status = {"invalid_request_error": 400, "tokens": 429, "requests": 429}.get(e.get("type") or "", 500)
    body = render.error_body(e.get("message"), e.get("type"), e.get("param"), e.get("code"))
    return False, render.batch_answered_line(job.id, job.custom_id, status, body)


def _result_file(b: Batch, kind: str) -> File:
    """An output or error file being written: hidden (like an upload in progress) until the batch ends;
    it expires `output_expires_after.seconds` after its creation (30 days by default)."""
    now = datetime.now(UTC)
    return File(
        id=files.new_file_id(),
        tenant_id=b.tenant_id,
        purpose="batch_output",
        filename=f"{b.id}_{kind}.jsonl",
        bytes=0,
        lines=0,
        status=FileStatus.processing.value,
        deleted=True,
        created_at=now,
        expires_at=now + timedelta(seconds=b.output_expires_s or expiry.DEFAULT_S),
    )


def write_results(session: Session, b: Batch, slice_rows: int, fingerprints: render.Fingerprints) -> tuple[bool, int]:
    """Up to `slice_rows` more of the batch's lines, in input order, into its output and error files,
    from where the last pass stopped (`results_line`). (True once every line is written, lines written)."""
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
        return False, n
    for f in (out, err):
        if f.lines:
            f.status, f.deleted = FileStatus.processed.value, False
        else:
            session.delete(f)
    b.output_file_id = out.id if out.lines else None
    b.error_file_id = err.id if err.lines else None
    return True, n


# Lines one pass expires, cancels or writes out for one tenant (its batches share them), each batch's
# share its own transaction: a 2M-line batch whose window ends is worked through over several passes
# instead of one statement holding every row, and the keeper comes back at once while a batch has
# more to do. One tenant's huge batches therefore cost every other tenant at most a slice a pass.
SLICE = 5000
# Batches of one tenant a pass looks at: a tenant with hundreds of live batches is worked through over
# several passes, each going on where its last stopped (`Rotation`), never ahead of another tenant.
PER_TENANT = 8


@dataclass
class Pass:
    ended: int = 0  # batches that reached their final status
    # Some batch stopped at a full slice, or a tenant has more batches waiting for the keeper than one
    # pass takes: call again without waiting.
    more: bool = False
    looked_at: int = 0  # batches this pass locked and looked at


class Rotation:
    """Where each tenant's last pass stopped, so that the next one goes on after it: every live batch
    is looked at within (its tenant's live batches / PER_TENANT) passes, whatever its age. The keeper
    keeps one for its lifetime (the dispatcher holds it); a pass without one starts every tenant at
    the beginning of its turn (batches needing the keeper still come first)."""

    def __init__(self) -> None:
        # "<tenant>:<1 needs the keeper | 0 rest>" -> the last batch id looked at in that group.
        self.after: dict[str, str] = {}

    @staticmethod
    def key(tenant_id: int, urgent: bool) -> str:
        return f"{tenant_id}:{int(urgent)}"


def _urgent() -> ColumnElement[bool]:
    """A live batch the keeper has work for now: cancelled, finalizing, past its window, or every line
    ended (the trigger's counts; `has_live_lines` still decides). The rest only wait for their lines."""
    total = Batch.request_counts["total"].astext.cast(BigInteger)
    return or_(
        Batch.status.in_([BatchStatus.cancelling.value, BatchStatus.finalizing.value]),
        Batch.expires_at <= func.now(),
        and_(total > 0, Batch.lines_completed + Batch.lines_failed >= total),
    )


def _pick(session: Session, rotation: Rotation, per_tenant: int) -> list[Any]:
    """Up to `per_tenant` + 1 live batches of every tenant that has some, ranked within the tenant:
    those needing the keeper first, then each group in turn after where its last pass stopped. One
    window-function query over the live batches (ix_batches_status), no limit across tenants."""
    urgent = case((_urgent(), 1), else_=0)
    key = func.concat(cast(Batch.tenant_id, Text), ":", urgent)
    after = func.coalesce(func.jsonb_extract_path_text(bindparam("after", type_=JSONB), key), "")
    turn_taken = case((Batch.id <= after, 1), else_=0)  # looked at in the group's current turn
    rank = func.row_number().over(partition_by=Batch.tenant_id, order_by=(urgent.desc(), turn_taken, Batch.id))
    ranked = (
        select(Batch.id, Batch.tenant_id, urgent.label("urgent"), rank.label("rank"))
        .where(Batch.status.in_([s.value for s in LIVE]))
        .subquery()
    )
    stmt = (
        select(ranked.c.id, ranked.c.tenant_id, ranked.c.urgent, ranked.c.rank)
        .where(ranked.c.rank <= per_tenant + 1)
        .order_by(ranked.c.rank, ranked.c.tenant_id)  # tenant by tenant: one of each, then the next of each
    )
    return list(session.execute(stmt, {"after": rotation.after}).all())


def any_live() -> Exists:
    """Some batch is in progress, cancelling or finalizing: `advance` has something to move."""
    return exists().where(Batch.status.in_([s.value for s in LIVE]))


def advance(
    sessions: sessionmaker[Session],
    lifecycle: Lifecycle,
    slice_rows: int = SLICE,
    rotation: Rotation | None = None,
    per_tenant: int = PER_TENANT,
) -> Pass:
    """Move live batches along: expiry, cancellation, finalization; one transaction per batch.

    Fair across tenants: every tenant with live batches gets up to `per_tenant` of them looked at,
    interleaved with the others', and its batches share `slice_rows` lines ended or written a pass.
    A batch's queued lines end (expired or cancelled) through the job lifecycle like every job: the
    state change and one usage count per line in the batch's transaction, then, once it committed,
    each line's reservation settled and its terminal event published. Counts need no work here:
    a trigger on jobs keeps them as lines end."""
    done = Pass()
    rotation = rotation if rotation is not None else Rotation()
    fingerprints = render.Fingerprints(lifecycle.settings)  # of the lines written out this pass
    with sessions() as session:
        picks = _pick(session, rotation, per_tenant)
    live_tenants = {f"{tenant_id}:" for _, tenant_id, _, _ in picks}  # the others' places are forgotten
    rotation.after = {k: v for k, v in rotation.after.items() if k[: k.index(":") + 1] in live_tenants}
    budget: dict[int, int] = {}  # lines each tenant may still end or write this pass
    for batch_id, tenant_id, urgent, rank in picks:
        if rank > per_tenant:
            done.more |= bool(urgent)  # more of this tenant's batches need the keeper than one pass takes
            continue
        left = budget.setdefault(tenant_id, slice_rows)
        if left <= 0:  # its share of this pass is spent: its next pass starts here
            done.more = True
            continue
        rotation.after[Rotation.key(tenant_id, bool(urgent))] = batch_id
        with sessions() as session:
            b = session.scalars(
                select(Batch)
                .where(Batch.id == batch_id, Batch.status.in_([s.value for s in LIVE]))
                .with_for_update(skip_locked=True)
            ).first()
            if b is None:  # ended meanwhile, or another keeper holds it
                continue
            done.looked_at += 1
            try:
                step = _step(session, lifecycle, b, left, fingerprints)
                session.commit()
            except Exception:  # this batch's pass is rolled back whole; the others go on
                log.exception("batch %s: bookkeeping pass failed; retried on the next pass", batch_id)
                session.rollback()
                continue
        if step.lines is not None:
            lifecycle.announce_lines(*step.lines)
        budget[tenant_id] = left - step.rows
        done.ended += step.ended
        done.more |= step.more
    return done


@dataclass
class _Step:
    ended: int = 0  # 1: the batch reached its final status
    more: bool = False  # stopped at its share of the slice
    rows: int = 0  # lines ended or written out (the tenant's share of the pass used)
    lines: tuple[list[Any], Ending] | None = None  # lines ended, to announce after the commit


def _step(
    session: Session, lifecycle: Lifecycle, b: Batch, slice_rows: int, fingerprints: render.Fingerprints
) -> _Step:
    """One batch's share of a pass, at most `slice_rows` lines ended or written."""
    now = datetime.now(UTC)
    out = _Step()
    if b.status == BatchStatus.in_progress and b.expires_at <= now and b.expired_at is None:
        b.expired_at = now  # lines not started are done for; running ones may finish
    to = None
    if b.status == BatchStatus.in_progress and b.expired_at is not None:
        to = Ending.expired
    if b.status == BatchStatus.cancelling:
        to = Ending.cancelled
    if to is not None:
        rows = lifecycle.end_queued_lines(session, b.id, to, slice_rows)
        out.lines, out.rows = (rows, to), len(rows)
        if out.rows >= slice_rows:  # the rest in the next passes; finalizing waits until then
            out.more = True
            return out
    if b.status != BatchStatus.finalizing:
        if session.scalar(has_live_lines(b.id)):
            return out
        finalizing(b, now)
    whole, written = write_results(session, b, slice_rows - out.rows, fingerprints)
    out.rows += written
    if not whole:
        out.more = True
        return out
    session.flush()
    session.refresh(b, ["lines_completed", "lines_failed"])  # the trigger's counts, this transaction's included
    end(b, ending(b), now)
    log.info("batch %s %s: %s", b.id, b.status, counts(b))
    out.ended = 1
    return out


def expires_at(created: datetime, window: str) -> datetime:
    """When a batch created at `created` expires (a stored window past the bounds is clamped)."""
    secs = window_seconds(window) if len(window) <= MAX_WINDOW_CHARS else None
    return created + timedelta(seconds=min(secs or 86400, MAX_WINDOW_S))
