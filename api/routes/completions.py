"""POST /v1/completions: validate, persist, enqueue, then stream, wait, or answer 202."""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse

from api.deps import PrincipalDep, RedisDep, SessionDep, SettingsDep
from api.errors import APIError, error_body
from api.jobs_access import cancel_job, sse_chunks, terminal_row_check
from api.limits import admit
from api.schemas import CompletionRequest, completion_body, job_body
from api.streaming import HEARTBEAT, follow
from api.translate import reservation, to_generation
from core import jobs, ratelimit
from core.db import async_sessions
from core.dispatch import submit
from core.metrics import ADMITTED
from core.registry import served_models
from core.tokenizer import context_length, tokenizer_for

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
):
    tenant = principal.tenant
    headers: dict[str, str] = {}
    unknown = body.unknown_fields()
    if unknown:
        if settings.unknown_params != "ignore":
            raise APIError(
                400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unknown_parameter"
            )
        headers["x-spool-ignored-params"] = ",".join(unknown)
    if body.model not in served_models(settings):
        raise APIError(
            404,
            f"The model '{body.model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    tok = await anyio.to_thread.run_sync(tokenizer_for, body.model)
    params, prompts = await anyio.to_thread.run_sync(to_generation, body, settings, tok)
    job = jobs.new_job(
        tenant_id=tenant.id,
        model=body.model,
        params=params.to_json(),
        prompts=prompts,
        stream=bool(body.stream),
        user=body.user,
        priority=body.priority or 0,
    )
    job.key_id = principal.key.id
    job.reserved_tokens = reservation(params, prompts, context_length(tok, settings))
    headers |= await admit(redis, principal, job.id, job.reserved_tokens)
    try:
        await submit(session, job, cap=tenant.max_concurrent)
    except Exception:
        await ratelimit.settle_async(redis, job.id, 0)  # nothing was stored: give the limits back
        raise
    ADMITTED.labels(str(tenant.id), body.model).inc()

    if "respond-async" in request.headers.get("prefer", ""):
        return JSONResponse(job_body(job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}", **headers})
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_stream(job, include_usage, tenant.id, redis, settings), headers=headers)
    return await _wait(job, tenant.id, redis, settings, headers)


async def _stream(job, include_usage: bool, tenant_id: int, redis, settings):
    finished = False
    try:
        async for chunk in sse_chunks(job, tenant_id, redis, include_usage=include_usage):
            yield chunk
        finished = True
    finally:
        if not finished and settings.cancel_on_disconnect:
            # The client went away mid-stream: stop spending the engine on it. Shielded, because
            # this generator is being cancelled.
            await asyncio.shield(_cancel_quietly(job.id, tenant_id, redis))


async def _cancel_quietly(job_id: str, tenant_id: int, redis) -> None:
    try:
        async with async_sessions()() as session:
            await cancel_job(session, redis, job_id, tenant_id)
    except Exception:
        log.warning("cancel after disconnect failed for %s", job_id, exc_info=True)


async def _wait(job, tenant_id: int, redis, settings, headers: dict[str, str]) -> JSONResponse:
    check = terminal_row_check(job.id, tenant_id)
    try:
        async with asyncio.timeout(settings.wait_timeout_s):
            async for item in follow(redis, job.id, check):
                if item is not HEARTBEAT and item[1].get("type") in ("done", "error", "cancelled"):
                    break
    except TimeoutError:
        return JSONResponse(job_body(job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}", **headers})
    async with async_sessions()() as session:
        row = (await session.execute(jobs.get_for_tenant(job.id, tenant_id))).scalar_one()
    if row.state == "succeeded":
        return JSONResponse(completion_body(row), headers=headers)
    err = {"param": None, "code": None, **(row.error or {"message": f"Job {row.state}.", "type": "server_error"})}
    status = _ERROR_STATUS.get(err.get("type", ""), 503)
    return JSONResponse(error_body(err["message"], err["type"], err["param"], err["code"]), status_code=status)
