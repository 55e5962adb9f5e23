"""Jobs: poll, stream (replayable SSE), cancel. Another tenant's job is a 404, never a 403."""

from __future__ import annotations

import re
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.sse import EventSourceResponse

from api.cache import SingleFlight
from api.costs import OffLoop, sized
from api.deps import CompletionsDep, FingerprintsDep, HubDep, LifecycleDep, RedisDep, SettingsDep, TenantDep
from api.errors import APIError
from api.sse import sse_chunks
from core.infra.orm import Job
from core.infra.streams import read
from core.jobs.service import Completions
from core.protocol import render
from core.protocol.schemas import JobObject
from core.states import JobState

router = APIRouter(prefix="/v1/jobs")
_EVENT_ROWS: SingleFlight[Job | None] = SingleFlight(ttl_s=2.0)


# Every id Spool issues fits this; anything else (a NUL byte Postgres refuses, megabytes of text)
# is answered before it reaches the database.
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _not_found(job_id: str) -> APIError:
    return APIError(404, f"No job with id {job_id[:128]!r}.", param="job_id", code="job_not_found")


async def _get(completions: Completions, job_id: str, tenant_id: int, *, without_result: bool = False) -> Job | None:
    """The tenant's job, as a client may read it: a deleted or unstored response is unknown here too."""
    if not _ID.fullmatch(job_id):
        return None
    return await completions.readable(job_id, tenant_id, without_result=without_result)


# A job object with more scores than this (logprobs) or this much text is built and encoded on a
# worker thread: 200k logprob entries took over 3 s, during which no other stream moved.
_OFF_LOOP_SCORES = 2000
_OFF_LOOP_CHARS = 256 * 1024


def _large(row: Job) -> bool:
    choices = (row.result or {}).get("choices") or []
    scores = sum(len(c.get("scores") or ()) + len(c.get("prompt_scores") or ()) for c in choices)
    return scores > _OFF_LOOP_SCORES or sum(len(c.get("text") or "") for c in choices) > _OFF_LOOP_CHARS


def _job_body(row: Job, fingerprint: str, waiting_for: str | None = None) -> dict[str, Any]:
    """The job object as its response model publishes it (the same validation FastAPI would run)."""
    body = {**render.job(row, fingerprint), "waiting_for": waiting_for}
    return JobObject.model_validate(body).model_dump(mode="json", by_alias=True)


def _answer(tenant_id: int, row: Job, fingerprint: str, waiting_for: str | None = None) -> OffLoop:
    # A job without many scores or much text is built on the loop: less than the thread hop.
    return OffLoop(tenant_id, _job_body, (row, fingerprint, waiting_for), inline=not _large(row))


@router.get("/{job_id}", response_model=JobObject)
@sized
async def get_job(
    job_id: str, tenant: TenantDep, completions: CompletionsDep, fingerprints: FingerprintsDep
) -> OffLoop:
    row = await _get(completions, job_id, tenant.id)
    if row is None:
        raise _not_found(job_id)
    # Held for a worker: queued while its model has none live (a model scaled to zero).
    held = row.state == JobState.queued.value and not await completions.has_worker(row.model)
    return _answer(tenant.id, row, fingerprints(row.model), "worker" if held else None)


@router.post("/{job_id}/cancel", response_model=JobObject)
@sized
async def cancel(
    job_id: str, tenant: TenantDep, lifecycle: LifecycleDep, completions: CompletionsDep, fingerprints: FingerprintsDep
) -> OffLoop:
    if await _get(completions, job_id, tenant.id, without_result=True) is None:  # unknown, or a forgotten response
        raise _not_found(job_id)
    row = await anyio.to_thread.run_sync(lifecycle.cancel, job_id, tenant.id)
    if row is None:
        raise _not_found(job_id)
    return _answer(tenant.id, row, fingerprints(row.model))


@router.get(
    "/{job_id}/events",
    response_model=None,
    # A plain Response class: FastAPI would run an EventSourceResponse route as an SSE producer, and it
    # adds no JSON body to the document for a class with no media type (the stream is declared below).
    response_class=Response,
    responses={200: {"content": {"text/event-stream": {}}, "description": "Completion chunks (SSE)"}},
)
@sized
async def job_events(
    job_id: str,
    request: Request,
    tenant: TenantDep,
    redis: RedisDep,
    hub: HubDep,
    completions: CompletionsDep,
    fingerprints: FingerprintsDep,
    settings: SettingsDep,
    last_event_id: str | None = None,
) -> EventSourceResponse:
    """Replay the job as OpenAI completion chunks from the start, or after `Last-Event-ID` (the
    header, or the `last_event_id` query parameter for clients that cannot set headers)."""
    # Many readers of one job share one lookup (what is read here never changes; the stream and the
    # terminal check read the rest), without the job's result: each stream holds its row.
    row = await _EVENT_ROWS.get((job_id, tenant.id), lambda: _get(completions, job_id, tenant.id, without_result=True))
    if row is None:
        raise _not_found(job_id)
    given = request.headers.get("last-event-id") or last_event_id or "0-0"
    start = read.parse_id(given)
    if start is None:
        raise APIError(
            400,
            f"Invalid Last-Event-ID {given[:64]!r}: expected an event id such as '1700000000000-0'.",
            param="Last-Event-ID",
            code="invalid_value",
        )
    stream = sse_chunks(
        row,
        tenant.id,
        redis,
        hub,
        lookup=completions.get,
        include_usage=True,
        fingerprint=fingerprints(row.model),
        last_id=start,
        heavy_cap=settings.replays_per_tenant,
    )
    return EventSourceResponse(stream)
