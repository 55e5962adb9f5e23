"""Turning a batch's input file into jobs: every line through the same validation and
translation as an interactive request (core/protocol/translate.py; a `/v1/responses` line first
through core/protocol/responses.to_chat), all or nothing.

Runs in a thread of the dispatcher process (`run_validator`, given its sessions, Redis and
settings by `spool dispatcher`), never in the API (an import contract). The whole file is
read one chunk at a time, lines are
validated one by one and COPYed into a staging table in ONE transaction (`validate`): if any line is bad, the
batch fails listing every bad line (up to SPOOL_BATCH_MAX_ERRORS) and no job exists; if the
process dies midway, nothing was committed and another replica picks the batch up when its
validation lease lapses.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from core.batches.status import cancelled, rejected, validated
from core.config import Settings
from core.errors import DomainError
from core.files import storage as files
from core.infra import redis_keys
from core.infra.orm import Batch
from core.infra.tokenizers import context_length, tokenizer_for
from core.infra.transient import TRANSIENT
from core.jobs import transitions as jobs
from core.jobs import workers
from core.jobs.service import translate
from core.protocol import render
from core.protocol import responses as wire
from core.protocol.errors import from_validation
from core.protocol.responses import ResponseChat, ResponsesRequest
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from core.protocol.translate import reservation
from core.registry import resolve, settings_for
from core.states import BatchStatus, JobKind

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


def validate(sessions: sessionmaker[Session], batch_id: str, settings: Settings) -> str:
    """Validate and enqueue one batch; returns its new status.

    Rows are COPYed into a temporary staging table as lines are validated (COPY: ~10x faster than
    INSERTs), duplicate custom_ids are found by one GROUP BY there, and only a clean file moves into
    `jobs` (one INSERT ... SELECT) in the same transaction that marks the batch in_progress."""
    from psycopg.types.json import Jsonb

    with sessions() as session, sessions() as reader:
        b = session.get(Batch, batch_id)
        if b is None or b.status != BatchStatus.validating:
            return b.status if b else "missing"
        errors: list[dict[str, Any]] = []
        extra_errors = 0
        total = 0

        def note(line_no: int | None, entry: dict[str, Any]) -> None:
            nonlocal extra_errors
            if len(errors) < settings.batch_max_errors:
                errors.append({**entry, "line": line_no})
            else:
                extra_errors += 1

        raw_conn: Any = session.connection().connection.driver_connection  # psycopg's, for COPY
        with raw_conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE batch_staging (LIKE jobs INCLUDING DEFAULTS) ON COMMIT DROP")
            with cur.copy(f"COPY batch_staging ({COLS_SQL}) FROM STDIN") as copy:
                # The file is read on a second connection: this one is busy with the COPY.
                lines = files.iter_lines(reader, b.input_file_id, settings.max_body_bytes)
                for line_no, raw in enumerate(lines, start=1):
                    if total >= settings.batch_max_lines and (isinstance(raw, files.LineTooLong) or raw.strip()):
                        # Stop at the cap: the rest of the file is not worth validating.
                        errors.insert(0, _too_many_lines(settings.batch_max_lines))
                        break
                    if isinstance(raw, files.LineTooLong):
                        total += 1
                        note(line_no, _too_long(raw.size, settings.max_body_bytes))
                        continue
                    if not raw.strip():
                        continue
                    total += 1
                    try:
                        row = _job_row(line_no, raw, b, settings)
                    except _LineError as exc:
                        note(line_no, exc.entry)
                        continue
                    row["params"], row["prompts"] = Jsonb(row["params"]), Jsonb(row["prompts"])
                    row["chat"] = Jsonb(row["chat"]) if row["chat"] is not None else None
                    copy.write_row([row[c] for c in COLUMNS])
            cur.execute(
                "SELECT custom_id, (array_agg(line_no ORDER BY line_no))[2:] FROM batch_staging "
                "GROUP BY custom_id HAVING count(*) > 1 LIMIT %s",
                (settings.batch_max_errors,),
            )
            for custom_id, later in cur.fetchall():
                for line_no in later:
                    note(
                        line_no,
                        {
                            "code": "duplicate_custom_id",
                            "param": "custom_id",
                            "message": f"custom_id '{clip(custom_id)}' appears on an earlier line.",
                        },
                    )
            if total and not errors:
                over = _over_enqueued_tokens(cur, b.tenant_id, settings.batch_max_enqueued_tokens)
                if over is not None:
                    errors.append(over)
                else:
                    cur.execute(f"INSERT INTO jobs ({COLS_SQL}) SELECT {COLS_SQL} FROM batch_staging")
        errors.sort(key=lambda e: e["line"] or 0)
        now = datetime.now(UTC)
        if total == 0:
            errors.append(
                {"code": "empty_file", "message": "The input file has no requests.", "param": None, "line": None}
            )
        if errors:
            session.rollback()
            if extra_errors:
                errors.append(
                    {
                        "code": "too_many_errors",
                        "param": None,
                        "line": None,
                        "message": f"{extra_errors} more lines are invalid.",
                    }
                )
            listed = render.listing(errors)
            moved: Any = session.execute(rejected(batch_id, now, total, listed))  # an UPDATE's result: rowcount
            session.commit()
            return BatchStatus.failed if moved.rowcount else BatchStatus.cancelled
        moved = session.execute(validated(batch_id, now, total))
        if not moved.rowcount:  # cancelled while validating: none of its lines may run
            session.rollback()
            session.execute(cancelled(batch_id, now))
            session.commit()
            return BatchStatus.cancelled
        session.commit()
        log.info("batch %s: %d lines queued", batch_id, total)
        return BatchStatus.in_progress


def claim_next(sessions: sessionmaker[Session], lease_s: float) -> str | None:
    """Take one batch awaiting validation (or whose validator died), for this process."""
    from datetime import timedelta

    from sqlalchemy import func, or_

    with sessions() as session:
        picked = (
            select(Batch.id)
            .where(
                Batch.status == BatchStatus.validating, or_(Batch.lease_until.is_(None), Batch.lease_until < func.now())
            )
            .order_by(Batch.created_at)
            .limit(1)
            .with_for_update(skip_locked=True)
            .scalar_subquery()
        )
        got = session.scalar(
            update(Batch)
            .where(Batch.id == picked)
            .values(lease_until=func.now() + timedelta(seconds=lease_s))
            .returning(Batch.id)
        )
        session.commit()
        return got


def run_validator(
    sessions: sessionmaker[Session],
    rds: Any,
    settings: Settings,
    poll_s: float = 2.0,
    stop: threading.Event | None = None,
) -> None:
    """Validate batches one at a time, until `stop` (a dispatcher thread: forever). Safe with several
    running: a batch is claimed under a lease, and taken over when the lease of a dead validator lapses."""
    _warm(settings)
    while stop is None or not stop.is_set():
        batch_id = None
        try:
            batch_id = claim_next(sessions, settings.batch_validation_lease_s)
            if batch_id:
                if validate(sessions, batch_id, settings) == BatchStatus.in_progress:
                    _wake_dispatcher(rds)
                continue
            rds.blpop([redis_keys.BATCH_VALIDATE_WAKE], timeout=poll_s)
        except TRANSIENT:
            log.warning("batch validation: Postgres/Redis unavailable; will retry", exc_info=True)
            time.sleep(poll_s)
        except Exception:
            if not batch_id:
                # No batch's fault: the claim or the wait failed in a way that is not an outage (a
                # Redis refusing this client, say). Wait and ask again: this loop once spun here,
                # logging thousands of tracebacks a second.
                log.exception("batch validation: error outside any batch; will retry")
                time.sleep(poll_s)
                continue
            # Not an outage: the file itself breaks validation. Retrying would loop forever (a
            # poison batch); fail it, with a message that shows no internals.
            log.exception("batch %s: validation failed; failing the batch", batch_id)
            try:
                give_up(sessions, batch_id)
            except Exception:  # Postgres away now: the batch's lease lapses and a later pass takes it again
                log.warning("batch %s: could not fail it now; a later pass will", batch_id, exc_info=True)
                time.sleep(poll_s)


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
        workers.wake_dispatcher(rds)
    except Exception:  # best effort, whatever Redis answers: the batch is valid and stays so
        log.warning("batch validated; could not wake the dispatcher: its lines start at its next tick")


def give_up(sessions: sessionmaker[Session], batch_id: str) -> None:
    error = {
        "code": "validation_failed",
        "message": "The input file could not be validated; check that every line is a JSON request.",
        "param": None,
        "line": None,
    }
    with sessions() as session:
        session.execute(rejected(batch_id, datetime.now(UTC), 0, render.listing([error])))
        session.commit()
