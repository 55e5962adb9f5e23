"""POST /v1/completions and /v1/chat/completions: create the job, then stream it, wait for it, or
answer 202 (one flow: the request type decides the translation and the rendering)."""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse

from api.deps import HubDep, LifecycleDep, PrincipalDep, RedisDep, SettingsDep
from api.streaming import readers, sse, sse_chunks
from core.jobs import service
from core.jobs.lifecycle import Lifecycle
from core.protocol import render
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
router = APIRouter()

# A stored job that did not succeed. Its own request's fault keeps a 400; anything else is a 422,
# never a 5xx: the SDK retries 5xx, and a retry without an Idempotency-Key would be a second job.
_ERROR_STATUS = {"invalid_request_error": 400, "cancelled": 409}


@router.post("/v1/completions", response_model=None)
@router.post("/v1/openai/v1/completions", response_model=None, include_in_schema=False)  # Llama Stack's path
async def create_completion(
    body: CompletionRequest,
    request: Request,
    principal: PrincipalDep,
    redis: RedisDep,
    hub: HubDep,
    settings: SettingsDep,
    lifecycle: LifecycleDep,
):
    return await _serve(body, "/v1/completions", request, principal, redis, hub, settings, lifecycle)


@router.post("/v1/chat/completions", response_model=None)
@router.post("/v1/openai/v1/chat/completions", response_model=None, include_in_schema=False)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    principal: PrincipalDep,
    redis: RedisDep,
    hub: HubDep,
    settings: SettingsDep,
    lifecycle: LifecycleDep,
):
    return await _serve(body, "/v1/chat/completions", request, principal, redis, hub, settings, lifecycle)


async def _serve(body, endpoint: str, request: Request, principal, redis, hub, settings, lifecycle: Lifecycle):
    """One flow for both endpoints: create the job, then stream it, wait for it, or answer 202."""
    queued = "respond-async" in request.headers.get("prefer", "")
    key = request.headers.get("idempotency-key")
    rid = getattr(request.state, "request_id", None)
    created = await service.create_completion(
        redis, principal, body, settings, key, endpoint, queued=queued, request_id=rid
    )
    job, headers, tenant_id = created.job, created.headers, principal.tenant.id
    if queued:
        return _accepted(job, headers)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = sse_chunks(job, tenant_id, redis, hub, include_usage=include_usage)
        guarded = _cancel_if_abandoned(stream, job.id, tenant_id, lifecycle, settings, request.app.state)
        return EventSourceResponse(guarded, headers=headers)
    row = await service.wait(hub, job.id, tenant_id, settings.wait_timeout_s)
    if row is None:
        return _accepted(job, headers)
    if row.state == "succeeded":
        return JSONResponse(render.response(row), headers=headers)
    err = render.failure(row)
    return JSONResponse(
        {"error": err}, status_code=_ERROR_STATUS.get(err["type"], 422), headers={"x-spool-job-id": row.id}
    )


def _accepted(job, headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(render.job(job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}", **headers})


async def _cancel_if_abandoned(stream, job_id: str, tenant_id: int, lifecycle: Lifecycle, settings, state):
    """Pass the stream through; if its client really went away, cancel the job after a grace period
    unless another reader (a reconnect with Last-Event-ID) follows it by then. A stream that ended
    because this server is shutting down, or because of an error on our side, cancels nothing: the
    job goes on, and its client can re-attach to /v1/jobs/{id}/events."""
    abandoned = ended = False
    try:
        async for chunk in stream:
            # A client that closes right after the final `[DONE]` has read everything: nothing to cancel
            # (and the job has ended anyway).
            ended = chunk.startswith(_DONE)
            yield chunk
    except (GeneratorExit, asyncio.CancelledError):
        abandoned = not ended
        raise
    finally:
        if abandoned and settings.cancel_on_disconnect and not getattr(state, "draining", False):
            task = asyncio.get_running_loop().create_task(
                _cancel_after_grace(lifecycle, state.redis, job_id, tenant_id, settings.disconnect_grace_s)
            )
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)


_DONE = sse(render.DONE)
_PENDING: set[asyncio.Task] = set()  # keeps grace-period tasks alive until they finish


async def _cancel_after_grace(lifecycle: Lifecycle, redis, job_id: str, tenant_id: int, grace_s: float) -> None:
    try:
        await asyncio.sleep(grace_s)
        if await readers(redis, job_id):
            return  # the client (or another) is following the job again
        await anyio.to_thread.run_sync(lifecycle.cancel, job_id, tenant_id)
    except Exception:
        log.warning("cancel after disconnect failed for %s", job_id, exc_info=True)
