"""Turning a batch's input file into jobs: every line through the same validation and
translation as an interactive request (core/protocol/translate.py; a `/v1/responses` line first
through core/protocol/responses.to_chat), all or nothing.

Runs in a thread of the dispatcher process (`run_validator`, given its sessions, Redis and
settings by `spool dispatcher`), never in the API (an import contract). The whole file is
read one chunk at a time, lines are validated one by one and COPYed into a staging table in ONE
transaction (`Validation`): if any line is bad, the batch fails listing every bad line (up to
SPOOL_BATCH_MAX_ERRORS) and no job exists; if the process dies midway, nothing was committed and
another replica picks the batch up when its validation lease lapses.

The validator's time is shared between tenants (`Validator`): several batches of different tenants
are open at once, each still one transaction, worked a slice of lines at a time, the tenant whose
turn is oldest first. A validation renews its lease while it works and writes only while the lease is
its own (compare-and-set on `lease_until`), so two validators never both commit a batch. Each
distinct constraint (grammar, schema, regex) of a file is compiled once (`constraints.Cache`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Update, and_, func, or_, select, update
from sqlalchemy.dialects.postgresql import distinct_on
from sqlalchemy.orm import Session, sessionmaker

from core.batches.transitions import cancelled, rejected, validated
from core.config import Settings
from core.errors import DomainError
from core.files import storage as files
from core.generation import constraints
from core.infra import redis_keys
from core.infra.orm import Batch
from core.infra.tokenizers import context_length, tokenizer_for
from core.infra.transient import TRANSIENT
from core.jobs import live_workers
from core.jobs import transitions as jobs
from core.jobs.service import translate
from core.protocol import render
from core.protocol import responses as wire
from core.protocol.errors import from_validation
from core.protocol.responses import ResponseChat, ResponsesRequest
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from core.protocol.translate import reservation
from core.registry import resolve, settings_for
from core.states import BatchStatus, JobKind
from core.tenancy import quota

log = logging.getLogger(__name__)

# One request type per batch endpoint (a batch has one endpoint; a line naming another is an error).
REQUESTS: dict[str, type[CompletionRequest] | type[ChatCompletionRequest] | type[ResponsesRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    # A line of a Responses batch runs as the chat request it translates into (`_as_chat`), as an
    # interactive `POST /v1/responses` does; its output line's body is the `response` object.
    "/v1/responses": ResponsesRequest,
}


# What an error message quotes of a client's own strings (a custom_id, a model name, a field name):
# enough to find it, never the whole of it (`batches.errors` lists up to SPOOL_BATCH_MAX_ERRORS entries).
QUOTE_CHARS = 100
# A whole message or param built by shared validation (pydantic's paths, translate's wording), clipped
# the same way as a last resort: a long dict key or path still cannot blow an entry up.
MESSAGE_CHARS = 500


def clip(text: object, limit: int = QUOTE_CHARS) -> str:
    """`text` cut to `limit` characters, with an ellipsis when cut."""
    s = str(text)
    return s if len(s) <= limit else s[:limit] + "…"


def _unquote_long(message: str, param: str | None) -> str:
    """A message written by shared validation that quotes a client's path (a dict key in it) in full."""
    if param and len(param) > QUOTE_CHARS:
        return message.replace(param, clip(param))
    return message


class _LineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.entry = {
            "code": code,
            "message": clip(message, MESSAGE_CHARS),
            "param": None if param is None else clip(param),
        }


def _job_row(line_no: int, raw: bytes, b: Batch, settings: Settings) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _LineError("invalid_json_line", f"This line is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise _LineError("invalid_request", "Each line must be a JSON object.")
    if not _storable_line(raw, obj):
        raise _LineError(
            "invalid_request",
            "The line contains a NUL character or an unpaired surrogate, which cannot be stored.",
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        raise _LineError("missing_custom_id", "Each line needs a 'custom_id' string (1-512 characters).", "custom_id")
    if obj.get("method", "POST") != "POST":
        raise _LineError("invalid_method", "'method' must be POST.", "method")
    if obj.get("url") != b.endpoint:
        raise _LineError("mismatched_url", f"'url' must be the batch's endpoint, {b.endpoint}.", "url")
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        names = sorted(extra)
        shown = ", ".join(repr(clip(n)) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise _LineError("invalid_request", f"Unknown fields on the line: {shown}.")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _LineError("invalid_request", "'body' must be a JSON object.", "body")
    try:
        parsed = REQUESTS[b.endpoint].model_validate(body)
    except ValidationError as exc:
        err = from_validation(exc.errors())  # the same wording an interactive request would get
        message = _unquote_long(err.message, err.param)
        raise _LineError(err.code or "invalid_request", message, err.param and f"body.{err.param}") from exc
    req = _as_chat(parsed, settings) if isinstance(parsed, ResponsesRequest) else parsed
    unknown = req.unknown_fields()
    if unknown and settings.unknown_params != "ignore":
        raise _LineError(
            "unknown_parameter", f"Unrecognized request argument supplied: {clip(unknown[0])}", f"body.{unknown[0]}"
        )
    if req.stream:
        raise _LineError("invalid_request", "'stream' is not supported in a batch.", "body.stream")
    served = resolve(req.model, settings)
    if served is None:
        raise _LineError("model_not_found", f"The model '{clip(req.model)}' does not exist.", "body.model")
    req.model = served
    ms, tok = settings_for(req.model, settings), tokenizer_for(req.model)
    try:
        params, prompts, chat = translate(req, ms, tok)
    except DomainError as exc:
        if isinstance(req, ResponseChat):
            wire.rename(exc)  # the Responses field's name, not chat's
        message = _unquote_long(exc.message, exc.param)
        raise _LineError(exc.code or "invalid_request", message, exc.param and f"body.{exc.param}") from exc
    if isinstance(req, ResponseChat):
        chat = {**(chat or {}), "response": req.response}  # what the `response` object echoes
    # A plain row for COPY (no ORM object), built as every new job's is.
    return jobs.new_row(
        tenant_id=b.tenant_id,
        key_id=b.key_id,
        model=req.model,
        kind=JobKind.batch,
        priority=req.priority or 0,
        params=params.to_json(),
        prompts=[p.to_json() for p in prompts],
        chat=chat,
        stream=False,
        user=req.user,
        batch_id=b.id,
        line_no=line_no,
        custom_id=custom_id,
        # What the line reserves against the tenant's limits when it dispatches (core/tenancy/admission.py).
        reserved_tokens=reservation(params, prompts, context_length(tok, ms)),
    )


def _as_chat(req: ResponsesRequest, settings: Settings) -> ResponseChat:
    """A Responses batch line as the chat request it runs as (core/protocol/responses.to_chat), with
    the 400s an interactive request would get. A line stands alone: no `previous_response_id` (its
    chain would be read while the file is validated, of responses that may change meanwhile) and no
    `background` (every line of a batch already runs without a connection)."""
    unknown = wire.unknown_fields(req)
    if unknown and settings.unknown_params != "ignore":
        raise _LineError(
            "unknown_parameter", f"Unrecognized request argument supplied: {clip(unknown[0])}", f"body.{unknown[0]}"
        )
    if req.stream:
        raise _LineError("invalid_request", "'stream' is not supported in a batch.", "body.stream")
    if req.background:
        raise _LineError(
            "unsupported_parameter",
            "'background' is not supported in a batch: every line already runs in the background.",
            "body.background",
        )
    if req.previous_response_id is not None:
        raise _LineError(
            "unsupported_parameter",
            "'previous_response_id' is not supported in a batch: send the conversation as 'input' items.",
            "body.previous_response_id",
        )
    try:
        return wire.to_chat(req, [], clip(req.model))
    except DomainError as exc:
        message = _unquote_long(exc.message, exc.param)
        raise _LineError(exc.code or "invalid_request", message, exc.param and f"body.{exc.param}") from exc


def _storable_line(raw: bytes, obj: Any) -> bool:
    """`_storable` without walking the line's values when its bytes cannot hold a NUL or a lone
    surrogate: only a `\\u` escape, the UTF-8 of a surrogate (lead byte 0xED: `json.loads` decodes
    bytes with surrogatepass) or a line in UTF-16/32 (NUL bytes) can. The walk was ~10 % of
    validating a line."""
    if b"\\u" not in raw and b"\xed" not in raw and b"\x00" not in raw:
        return True
    return _storable(obj)


def _storable(obj: Any) -> bool:
    """Postgres text and JSONB hold neither NUL characters nor unpaired UTF-16 surrogates."""
    if isinstance(obj, str):
        if "\x00" in obj:
            return False
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(obj, dict):
        return all(_storable(k) and _storable(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_storable(v) for v in obj)
    return True


def _too_long(size: int, limit: int) -> dict[str, Any]:
    return {
        "code": "line_too_long",
        "message": f"This line is {size} bytes; a request may be at most {limit} bytes.",
        "param": None,
    }


def _too_many_lines(limit: int) -> dict[str, Any]:
    return {
        "code": "batch_too_large",
        "message": f"The input file has more than {limit} requests, the most one batch may hold "
        "(SPOOL_BATCH_MAX_LINES). Split it into several batches.",
        "param": None,
        "line": None,
    }


def _over_enqueued_tokens(cur: Any, tenant_id: int, limit: int) -> dict[str, Any] | None:
    """OpenAI's batch queue limit: the tokens of this batch plus those of the tenant's unfinished
    batch lines. The transaction-scoped lock makes two batches of one tenant validated at once
    check one after the other (the second sees the first's lines), not both against the same room."""
    if limit <= 0:
        return None
    cur.execute("SELECT pg_advisory_xact_lock(hashtext('spool:batch-enqueue'), %s)", (tenant_id,))
    cur.execute("SELECT coalesce(sum(reserved_tokens), 0) FROM batch_staging")
    mine = int(cur.fetchone()[0])
    cur.execute(
        "SELECT coalesce(sum(reserved_tokens), 0) FROM jobs WHERE tenant_id = %s AND kind = 'batch' "
        "AND state IN ('queued', 'dispatched', 'running')",
        (tenant_id,),
    )
    enqueued = int(cur.fetchone()[0])
    if mine + enqueued <= limit:
        return None
    return {
        "code": "token_limit_exceeded",
        "message": f"Enqueued token limit reached: this batch needs {mine} tokens (prompt + max_tokens of every "
        f"line) and {enqueued} are already enqueued in unfinished batches; the limit is {limit} "
        "(SPOOL_BATCH_MAX_ENQUEUED_TOKENS). Try again once some in-progress batches have completed.",
        "param": None,
        "line": None,
    }


# The COPY's columns: those of every new job row (core/jobs/transitions.new_row), so the two never drift.
COLUMNS = tuple(jobs.new_row(tenant_id=0, model="", params={}, prompts=[], stream=False))
COLS_SQL = ", ".join(f'"{c}"' for c in COLUMNS)  # "user" is a reserved word


# Seconds one slice of one batch may take before the validator turns to the next tenant's (after the
# line in hand: a line is bounded by SPOOL_MAX_BODY_BYTES and the constraint limits).
SLICE_S = 1.0


@dataclass(frozen=True)
class Claim:
    """A batch taken for validation. Its `lease_until` is the claim's token: every later write of the
    validator (renewal, the final status) compares it, so one whose lease was taken commits nothing."""

    batch_id: str
    tenant_id: int
    lease_until: datetime


LOST = "batch %s: its validation lease was taken by another validator; this validation commits nothing"


class LeaseLost(Exception):
    """Another validator holds the batch now: this one's lease lapsed and was taken."""


class _Cancelled(Exception):
    """The batch was cancelled while it was being validated: none of its lines may run."""


def renew(sessions: sessionmaker[Session], batch_id: str, lease: datetime, lease_s: float) -> datetime:
    """The lease pushed `lease_s` on, if it is still `lease` (compare-and-set); the new token."""
    with sessions() as session:
        row = session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.lease_until == lease)
            .values(lease_until=func.now() + timedelta(seconds=lease_s))
            .returning(Batch.lease_until, Batch.status)
        ).first()
        session.commit()
    if row is None:
        raise LeaseLost(batch_id)
    if row.status != BatchStatus.validating:
        raise _Cancelled(batch_id)
    return row.lease_until


class Validation:
    """One batch validated a slice of lines at a time, all or nothing: its lines are validated and
    COPYed into a temporary staging table in ONE transaction, held open across slices (the COPY with
    it: a connection in COPY is not idle in a transaction), and only a clean file moves into `jobs`,
    in the transaction that marks the batch in_progress. The file is read on a second connection in
    autocommit: a reader parked between slices holds no transaction. With a lease (`Claim`), the
    lease is renewed while it works and every write compares it: a validator whose lease was taken
    stops at its next renewal, and in any case its final UPDATE matches no row, so nothing commits."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        batch_id: str,
        settings: Settings,
        lease: datetime | None = None,
        tenant_id: int = 0,
    ) -> None:
        self.sessions, self.batch_id, self.settings = sessions, batch_id, settings
        self.lease, self.tenant_id = lease, tenant_id
        self.renewed = time.monotonic()
        self.errors: list[dict[str, Any]] = []
        self.extra_errors = 0
        self.models: dict[str, None] = {}  # the models its valid lines name, in the order each first appears
        self.total = 0
        # Each distinct constraint of the file compiled once (a 50k-line file with one schema: once).
        self.cache = constraints.Cache()
        self._held = ExitStack()  # sessions and cursor
        self._copying = ExitStack()  # the COPY, ended before the file's checks
        self._in_copy = False
        self._done = False

    def open(self) -> str | None:
        """Start; the batch's status when it is not awaiting validation (nothing to do then)."""
        self.session = self._held.enter_context(self.sessions())
        b = self.session.get(Batch, self.batch_id)
        if b is None or b.status != BatchStatus.validating:
            self.close()
            return b.status if b else "missing"
        self.batch, self.tenant_id = b, b.tenant_id
        reader = self._held.enter_context(self.sessions())
        reader.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
        raw_conn: Any = self.session.connection().connection.driver_connection  # psycopg's, for COPY
        self.cur = self._held.enter_context(raw_conn.cursor())
        self.cur.execute("CREATE TEMP TABLE batch_staging (LIKE jobs INCLUDING DEFAULTS) ON COMMIT DROP")
        self._in_copy = True
        self.copy = self._copying.enter_context(self.cur.copy(f"COPY batch_staging ({COLS_SQL}) FROM STDIN"))
        self.lines = enumerate(files.iter_lines(reader, b.input_file_id, self.settings.max_body_bytes), start=1)
        return None

    def keep(self) -> None:
        """Renew the lease once a third of it has passed (LeaseLost: taken; _Cancelled: cancelled)."""
        lease_s = self.settings.batch_validation_lease_s
        if self.lease is None or time.monotonic() - self.renewed < lease_s / 3:
            return
        asked = time.monotonic()
        self.lease = renew(self.sessions, self.batch_id, self.lease, lease_s)
        self.renewed = asked

    def slice(self, most: int, seconds: float = math.inf) -> bool:
        """Up to `most` more lines, or `seconds`; True once the whole file is read (or the cap met)."""
        deadline = time.monotonic() + seconds
        with constraints.caching(self.cache):
            for n in range(most):
                if n and time.monotonic() >= deadline:
                    return False
                self.keep()
                item = next(self.lines, None)
                if item is None or not self._line(*item):
                    return True
        return False

    def _note(self, line_no: int | None, entry: dict[str, Any]) -> None:
        if len(self.errors) < self.settings.batch_max_errors:
            self.errors.append({**entry, "line": line_no})
        else:
            self.extra_errors += 1

    def _line(self, line_no: int, raw: bytes | files.LineTooLong) -> bool:
        """One line validated and staged (or noted as bad); False: the line cap is met, stop reading."""
        from psycopg.types.json import Jsonb

        settings = self.settings
        if self.total >= settings.batch_max_lines and (isinstance(raw, files.LineTooLong) or raw.strip()):
            # Stop at the cap: the rest of the file is not worth validating.
            self.errors.insert(0, _too_many_lines(settings.batch_max_lines))
            return False
        if isinstance(raw, files.LineTooLong):
            self.total += 1
            self._note(line_no, _too_long(raw.size, settings.max_body_bytes))
            return True
        if not raw.strip():
            return True
        self.total += 1
        try:
            row = _job_row(line_no, raw, self.batch, settings)
        except _LineError as exc:
            self._note(line_no, exc.entry)
            return True
        self.models.setdefault(row["model"])
        row["params"], row["prompts"] = Jsonb(row["params"]), Jsonb(row["prompts"])
        row["chat"] = Jsonb(row["chat"]) if row["chat"] is not None else None
        self.copy.write_row([row[c] for c in COLUMNS])
        return True

    @property
    def model(self) -> str | None:
        """The batch's `model`: the one its lines name. OpenAI takes one model per batch; Spool runs
        lines of several (each line is its own job), and then names them all, joined by ",", in the
        order each first appears. None: no valid line."""
        return ",".join(self.models) or None

    def _mine(self, stmt: Update) -> Update:
        """`stmt` only while this validator's lease is the batch's (a bare `validate` has none)."""
        return stmt if self.lease is None else stmt.where(Batch.lease_until == self.lease)

    def finish(self) -> str:
        """The file's checks, then the batch moved on; returns its new status (`validating`: the lease
        was taken, nothing committed)."""
        try:
            return self._finish()
        finally:
            self.close()

    def _finish(self) -> str:
        settings, cur, session = self.settings, self.cur, self.session
        self._in_copy = False
        self._copying.close()  # the COPY ends
        cur.execute(
            "SELECT custom_id, (array_agg(line_no ORDER BY line_no))[2:] FROM batch_staging "
            "GROUP BY custom_id HAVING count(*) > 1 LIMIT %s",
            (settings.batch_max_errors,),
        )
        for custom_id, later in cur.fetchall():
            for line_no in later:
                self._note(
                    line_no,
                    {
                        "code": "duplicate_custom_id",
                        "param": "custom_id",
                        "message": f"custom_id '{clip(custom_id)}' appears on an earlier line.",
                    },
                )
        errors, total = self.errors, self.total
        if total and not errors:
            over = _over_enqueued_tokens(cur, self.tenant_id, settings.batch_max_enqueued_tokens)
            if over is not None:
                errors.append(over)
            else:
                cur.execute(f"INSERT INTO jobs ({COLS_SQL}) SELECT {COLS_SQL} FROM batch_staging")
                over = quota.over_stored_batch(cur, self.tenant_id, self.batch_id, settings)  # rolled back below
                if over is not None:
                    errors.append(over)
        errors.sort(key=lambda e: e["line"] or 0)
        now = datetime.now(UTC)
        if total == 0:
            errors.append(
                {"code": "empty_file", "message": "The input file has no requests.", "param": None, "line": None}
            )
        if errors:
            session.rollback()
            if self.extra_errors:
                errors.append(
                    {
                        "code": "too_many_errors",
                        "param": None,
                        "line": None,
                        "message": f"{self.extra_errors} more lines are invalid.",
                    }
                )
            stmt = rejected(self.batch_id, now, total, render.listing(errors), self.model)
            moved: Any = session.execute(self._mine(stmt))
            if not moved.rowcount:  # an UPDATE's result: rowcount
                return self._not_moved()
            session.commit()
            return BatchStatus.failed
        moved = session.execute(self._mine(validated(self.batch_id, now, total, self.model)))
        if not moved.rowcount:  # cancelled, or the lease was taken: none of its lines may run from here
            return self._not_moved()
        session.commit()
        log.info("batch %s: %d lines queued", self.batch_id, total)
        return BatchStatus.in_progress

    def _not_moved(self) -> str:
        """The final UPDATE matched nothing: everything is rolled back; why says what follows."""
        session = self.session
        session.rollback()
        status = session.scalar(select(Batch.status).where(Batch.id == self.batch_id))
        if status == BatchStatus.cancelling:
            session.execute(cancelled(self.batch_id, datetime.now(UTC)))
            session.commit()
            return BatchStatus.cancelled
        if status == BatchStatus.validating:
            log.warning(
                "batch %s: its validation lease was taken by another validator; nothing committed", self.batch_id
            )
        return status or "missing"

    def cancel(self) -> str:
        """Cancelled while validating: the work dropped and the batch ended, no line ever queued."""
        self._fail_copy()
        try:
            self.session.rollback()
            self.session.execute(cancelled(self.batch_id, datetime.now(UTC)))
            self.session.commit()
        finally:
            self.close()
        log.info("batch %s: cancelled while it was being validated", self.batch_id)
        return BatchStatus.cancelled

    def abandon(self, release: bool = True) -> None:
        """Drop the work (the transaction rolls back: nothing of it stays) and, with `release`, let the
        lease go if it is still ours, so that a later pass takes the batch again at once."""
        self.close()
        if release and self.lease is not None:
            try:
                with self.sessions() as session:
                    session.execute(
                        update(Batch)
                        .where(Batch.id == self.batch_id, Batch.lease_until == self.lease)
                        .values(lease_until=None)
                    )
                    session.commit()
            except Exception:  # Postgres away: the lease lapses on its own
                log.warning("batch %s: could not let its validation lease go", self.batch_id, exc_info=True)

    def _fail_copy(self) -> None:
        """End an open COPY with an error (psycopg sends CopyFail), so the connection can roll back."""
        if not self._in_copy:
            return
        self._in_copy = False
        stop = _Abandoned()
        try:
            self._copying.__exit__(_Abandoned, stop, None)
        except Exception:  # the connection is gone: closing the session below discards it
            log.debug("batch %s: the COPY ended badly", self.batch_id, exc_info=True)

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._fail_copy()
        try:
            self._held.close()  # an open transaction is rolled back
        except Exception:
            log.debug("batch %s: closing its validation's connections failed", self.batch_id, exc_info=True)


class _Abandoned(Exception):
    """What an abandoned validation's COPY is ended with."""


def validate(sessions: sessionmaker[Session], batch_id: str, settings: Settings, lease: datetime | None = None) -> str:
    """Validate and enqueue one batch whole, all or nothing; returns its new status (`validating`: the
    lease, when one is given, was taken by another validator, and nothing was committed)."""
    v = Validation(sessions, batch_id, settings, lease)
    status = v.open()
    if status is not None:
        return status
    try:
        while not v.slice(settings.batch_validation_slice_lines):
            pass
        return v.finish()
    except LeaseLost:
        v.abandon(release=False)
        log.warning(LOST, batch_id)
        return BatchStatus.validating
    except _Cancelled:
        return v.cancel()
    finally:
        v.close()


def claim_next(
    sessions: sessionmaker[Session],
    lease_s: float,
    busy: Collection[int] = (),
    turns: Mapping[int, float] | None = None,
) -> Claim | None:
    """Take one batch awaiting validation (or whose validator's lease lapsed), for this process: the
    oldest of the tenant whose turn is oldest (`turns`: when each tenant's last slice ran; never: first),
    none of the `busy` tenants'. A compare-and-set on the lease: two validators never both take it."""
    turns = turns or {}
    waiting = and_(
        Batch.status == BatchStatus.validating,
        or_(Batch.lease_until.is_(None), Batch.lease_until < func.now()),
    )
    with sessions() as session:
        oldest = session.execute(
            select(Batch.id, Batch.tenant_id, Batch.created_at)
            .where(waiting, Batch.tenant_id.not_in(list(busy)))
            .ext(distinct_on(Batch.tenant_id))
            .order_by(Batch.tenant_id, Batch.created_at, Batch.id)
        ).all()
        for batch_id, tenant_id, _ in sorted(oldest, key=lambda r: (turns.get(r.tenant_id, 0.0), r.created_at)):
            lease = session.scalar(
                update(Batch)
                .where(Batch.id == batch_id, waiting)
                .values(lease_until=func.now() + timedelta(seconds=lease_s))
                .returning(Batch.lease_until)
            )
            session.commit()
            if lease is not None:
                return Claim(batch_id, tenant_id, lease)
        return None


class Validator:
    """The validator's schedule, shared between tenants the way the batch keeper shares its passes
    (core/batches/progress.py): up to `batch_validation_tenants` batches open at once, each of a
    different tenant; each step works one slice (`batch_validation_slice_lines` lines or SLICE_S) of
    the batch whose tenant's turn is oldest, a waiting tenant that has had no turn first. One tenant's
    50k-line file therefore costs another tenant's small batch a slice, not the whole file."""

    def __init__(self, sessions: sessionmaker[Session], rds: Any, settings: Settings) -> None:
        self.sessions, self.rds, self.settings = sessions, rds, settings
        self.open: list[Validation] = []
        self.turns: dict[int, float] = {}  # tenant -> when its last slice ran (monotonic)

    def step(self) -> bool:
        """One slice of work; False when there is none."""
        s = self.settings
        if len(self.open) < s.batch_validation_tenants:
            self._take()
        for v in list(self.open):  # a batch waiting for its turn keeps its lease too
            try:
                v.keep()
            except TRANSIENT:
                raise
            except Exception as exc:
                self._drop(v, exc)
        if not self.open:
            return False
        v = min(self.open, key=lambda v: self.turns.get(v.tenant_id, 0.0))
        self.turns[v.tenant_id] = time.monotonic()
        try:
            if not v.slice(s.batch_validation_slice_lines, SLICE_S):
                return True
            self.open.remove(v)
            if v.finish() == BatchStatus.in_progress:
                _wake_dispatcher(self.rds)
        except TRANSIENT:
            raise
        except Exception as exc:
            self._drop(v, exc)
        return True

    def _take(self) -> None:
        busy = {v.tenant_id for v in self.open}
        claim = claim_next(self.sessions, self.settings.batch_validation_lease_s, busy, self.turns)
        if claim is None:
            return
        v = Validation(self.sessions, claim.batch_id, self.settings, claim.lease_until, claim.tenant_id)
        try:
            if v.open() is None:
                self.open.append(v)
        except TRANSIENT:
            v.abandon()
            raise
        except Exception as exc:
            self._drop(v, exc)
        if len(self.turns) > 4096:  # tenants long gone: their turns are forgotten, oldest first
            for tenant_id in sorted(self.turns, key=self.turns.__getitem__)[:2048]:
                del self.turns[tenant_id]

    def _drop(self, v: Validation, exc: Exception) -> None:
        if v in self.open:
            self.open.remove(v)
        if isinstance(exc, LeaseLost):
            log.warning(LOST, v.batch_id)
            v.abandon(release=False)
            return
        if isinstance(exc, _Cancelled):
            v.cancel()
            return
        # Not an outage: the file itself breaks validation. Retrying would loop forever (a poison
        # batch); fail it, with a message that shows no internals.
        log.error("batch %s: validation failed; failing the batch", v.batch_id, exc_info=exc)
        v.abandon(release=False)
        try:
            give_up(self.sessions, v.batch_id, v.lease)
        except Exception:  # Postgres away now: the batch's lease lapses and a later pass takes it again
            log.warning("batch %s: could not fail it now; a later pass will", v.batch_id, exc_info=True)

    def release_all(self) -> None:
        """Every open validation dropped (an outage, or the thread stops): their leases let go."""
        for v in self.open:
            v.abandon()
        self.open = []


def run_validator(
    sessions: sessionmaker[Session],
    rds: Any,
    settings: Settings,
    poll_s: float = 2.0,
    stop: threading.Event | None = None,
) -> None:
    """Validate batches, shared between tenants (`Validator`), until `stop` (a dispatcher thread:
    forever). Safe with several running: a batch is claimed under a lease, renewed while it is
    validated, and taken over only when the lease of a dead validator lapses."""
    _warm(settings)
    validator = Validator(sessions, rds, settings)
    try:
        while stop is None or not stop.is_set():
            try:
                if validator.step():
                    continue
                rds.blpop([redis_keys.BATCH_VALIDATE_WAKE], timeout=poll_s)
            except TRANSIENT:
                log.warning("batch validation: Postgres/Redis unavailable; will retry", exc_info=True)
                validator.release_all()
                time.sleep(poll_s)
            except Exception:
                # No batch's fault (a batch's own errors fail that batch in `step`): the claim or the
                # wait failed in a way that is not an outage (a Redis refusing this client, say). Wait
                # and ask again: this loop once spun here, logging thousands of tracebacks a second.
                log.exception("batch validation: error outside any batch; will retry")
                time.sleep(poll_s)
    finally:
        validator.release_all()


def _warm(settings: Settings) -> None:
    """Load each served model's tokenizer now: the first batch would otherwise wait for it (~0.4 s
    for a GGUF's vocabulary). A model this host cannot load fails its lines later, as before."""
    for model in settings.model_ids:
        try:
            tokenizer_for(model)
        except Exception:
            log.warning("could not load the tokenizer of %s ahead of the first batch", model, exc_info=True)


def _wake_dispatcher(rds: Any) -> None:
    """The lines start now rather than at the dispatcher's next tick; without Redis they start then."""
    try:
        live_workers.wake_dispatcher(rds)
    except Exception:  # best effort, whatever Redis answers: the batch is valid and stays so
        log.warning("batch validated; could not wake the dispatcher: its lines start at its next tick")


def give_up(sessions: sessionmaker[Session], batch_id: str, lease: datetime | None = None) -> None:
    """The batch failed with a message that shows no internals (only while `lease`, if given, is ours)."""
    error = {
        "code": "validation_failed",
        "message": "The input file could not be validated; check that every line is a JSON request.",
        "param": None,
        "line": None,
    }
    with sessions() as session:
        stmt = rejected(batch_id, datetime.now(UTC), 0, render.listing([error]))
        session.execute(stmt if lease is None else stmt.where(Batch.lease_until == lease))
        session.commit()
