"""POST /v1/completions: create the job, then stream it, wait for it, or answer 202."""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse

from api.deps import LifecycleDep, PrincipalDep, RedisDep, SessionDep, SettingsDep
from api.streaming import sse_chunks
from core.jobs import service
from core.jobs.lifecycle import Lifecycle
from core.protocol import render
from core.protocol.schemas import CompletionRequest

log = logging.getLogger(__name__)
router = APIRouter()

# Job errors that are the client's fault keep their 4xx; the rest are the service's.
_ERROR_STATUS = {"invalid_request_error": 400, "cancelled": 409}


@router.post("/v1/completions", response_model=None)
@router.post("/v1/openai/v1/completions", response_model=None, include_in_schema=False)  # Llama Stack's path
async def create_completion(
    body: CompletionRequest,
    request: Request,
    principal: PrincipalDep,
    session: SessionDep,
    redis: RedisDep,
    settings: SettingsDep,
    lifecycle: LifecycleDep,
):
    created = await service.create_completion(session, redis, principal, body, settings)
    job, headers, tenant_id = created.job, created.headers, principal.tenant.id
    if "respond-async" in request.headers.get("prefer", ""):
        return _accepted(job, headers)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = sse_chunks(job, tenant_id, redis, include_usage=include_usage)
        return EventSourceResponse(
            _cancel_if_abandoned(stream, job.id, tenant_id, lifecycle, settings), headers=headers
        )
    row = await service.wait(redis, job.id, tenant_id, settings.wait_timeout_s)
    if row is None:
        return _accepted(job, headers)
    if row.state == "succeeded":
        return JSONResponse(render.completion(row), headers=headers)
    err = render.failure(row)
    return JSONResponse({"error": err}, status_code=_ERROR_STATUS.get(err["type"], 503))


def _accepted(job, headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(render.job(job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}", **headers})


async def _cancel_if_abandoned(stream, job_id: str, tenant_id: int, lifecycle: Lifecycle, settings):
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    finally:
        if not finished and settings.cancel_on_disconnect:
            # The client went away mid-stream: stop spending the engine on it. Shielded, because
            # this generator is being cancelled.
            await asyncio.shield(_cancel_quietly(lifecycle, job_id, tenant_id))


async def _cancel_quietly(lifecycle: Lifecycle, job_id: str, tenant_id: int) -> None:
    try:
        await anyio.to_thread.run_sync(lifecycle.cancel, job_id, tenant_id)
    except Exception:
        log.warning("cancel after disconnect failed for %s", job_id, exc_info=True)
