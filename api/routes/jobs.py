"""Jobs: poll, stream (replayable SSE), cancel. Another tenant's job is a 404, never a 403."""

from __future__ import annotations

import re

import anyio
from fastapi import APIRouter, Request
from fastapi.sse import EventSourceResponse

from api.cache import SingleFlight
from api.deps import CompletionsDep, FingerprintsDep, HubDep, LifecycleDep, RedisDep, TenantDep
from api.errors import APIError
from api.streaming import sse_chunks
from core.infra import streams
from core.infra.orm import Job
from core.jobs.service import Completions
from core.protocol import render
from core.protocol.schemas import JobObject

router = APIRouter(prefix="/v1/jobs")
_EVENT_ROWS: SingleFlight[Job | None] = SingleFlight(ttl_s=2.0)


# Every id Spool issues fits this; anything else (a NUL byte Postgres refuses, megabytes of text)
# is answered before it reaches the database.
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _not_found(job_id: str) -> APIError:
    return APIError(404, f"No job with id {job_id[:128]!r}.", param="job_id", code="job_not_found")


async def _get(completions: Completions, job_id: str, tenant_id: int) -> Job | None:
    return await completions.get(job_id, tenant_id) if _ID.fullmatch(job_id) else None


@router.get("/{job_id}", response_model=JobObject)
async def get_job(job_id: str, tenant: TenantDep, completions: CompletionsDep, fingerprints: FingerprintsDep) -> dict:
    row = await _get(completions, job_id, tenant.id)
    if row is None:
        raise _not_found(job_id)
    return render.job(row, fingerprints(row.model))


@router.post("/{job_id}/cancel", response_model=JobObject)
async def cancel(job_id: str, tenant: TenantDep, lifecycle: LifecycleDep, fingerprints: FingerprintsDep) -> dict:
    if not _ID.fullmatch(job_id):
        raise _not_found(job_id)
    row = await anyio.to_thread.run_sync(lifecycle.cancel, job_id, tenant.id)
    if row is None:
        raise _not_found(job_id)
    return render.job(row, fingerprints(row.model))


@router.get(
    "/{job_id}/events",
    response_model=None,
    responses={200: {"content": {"text/event-stream": {}}, "description": "Completion chunks (SSE)"}},
)
async def job_events(
    job_id: str,
    request: Request,
    tenant: TenantDep,
    redis: RedisDep,
    hub: HubDep,
    completions: CompletionsDep,
    fingerprints: FingerprintsDep,
    last_event_id: str | None = None,
) -> EventSourceResponse:
    """Replay the job as OpenAI completion chunks from the start, or after `Last-Event-ID` (the
    header, or the `last_event_id` query parameter for clients that cannot set headers)."""
    # Many readers of one job share one lookup (what is read here never changes; the stream and the
    # terminal check read the rest).
    row = await _EVENT_ROWS.get((job_id, tenant.id), lambda: _get(completions, job_id, tenant.id))
    if row is None:
        raise _not_found(job_id)
    given = request.headers.get("last-event-id") or last_event_id or "0-0"
    start = streams.parse_id(given)
    if start is None:
        raise APIError(
            400,
            f"Invalid Last-Event-ID {given[:64]!r}: expected an event id such as '1700000000000-0'.",
            param="Last-Event-ID",
            code="invalid_value",
        )
    stream = sse_chunks(
        row, tenant.id, redis, hub, include_usage=True, fingerprint=fingerprints(row.model), last_id=start
    )
    return EventSourceResponse(stream)
