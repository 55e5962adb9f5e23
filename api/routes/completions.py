"""POST /v1/completions and /v1/chat/completions: create the job, then stream it, wait for it, or
answer 202 (one flow: the request type decides the translation and the rendering)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Annotated, Any, NamedTuple, TypeVar

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse
from starlette.requests import ClientDisconnect

from api import deps
from api.bodies import INLINE_BYTES, json_body, openapi_answers, openapi_body
from api.costs import work
from api.deps import current_principal
from api.errors import APIError
from api.sse import readers, sse, sse_chunks
from core.config import Settings
from core.jobs.lifecycle import Lifecycle
from core.jobs.service import Completions
from core.protocol import render
from core.protocol.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ErrorResponse,
    JobObject,
)
from core.tenancy.keys import Principal

log = logging.getLogger(__name__)
router = APIRouter()

# A stored job that did not succeed. Its own request's fault keeps a 400; anything else is a 422,
# never a 5xx: the SDK retries 5xx, and a retry without an Idempotency-Key would be a second job.
_ERROR_STATUS = {"invalid_request_error": 400, "cancelled": 409, "service_unavailable": 503}

# Bodies are decoded and validated on the prepare threads (api/bodies.py), not by FastAPI on the loop.
_Completion = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
_Chat = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
_COMPLETION_DOC = openapi_body(CompletionRequest)
_CHAT_DOC = openapi_body(ChatCompletionRequest)
# What they answer, for /openapi.json: the handlers return responses of their own (JSON, SSE or 202),
# so the models document the wire and never re-serialize it.
_COMPLETION_ANSWERS = openapi_answers(Completion, CompletionChunk, JobObject, ErrorResponse)
_CHAT_ANSWERS = openapi_answers(ChatCompletion, ChatCompletionChunk, JobObject, ErrorResponse)


class _Call(NamedTuple):
    """What both routes need besides their body."""

    request: Request
    principal: Principal
    redis: Any
    hub: Any
    settings: Settings
    lifecycle: Lifecycle
    completions: Completions
    fingerprints: render.Fingerprints


async def _call(request: Request) -> _Call:
    """One dependency, read off the app's state: FastAPI solving eight (one coroutine each) cost
    ~8 % of the API's CPU per short request. Async: a plain def dependency runs on the thread pool."""
    state = request.app.state
    principal = await current_principal(request)
    return _Call(
        request,
        principal,
        state.redis,
        state.hub,
        await deps.settings(),
        state.lifecycle,
        state.completions,
        state.fingerprints,
    )


_CallDep = Annotated[_Call, Depends(_call)]


@router.post("/v1/completions", response_model=Completion, responses=_COMPLETION_ANSWERS, openapi_extra=_COMPLETION_DOC)
@router.post("/v1/openai/v1/completions", response_model=None, include_in_schema=False)  # Llama Stack's path
@work
async def create_completion(body: _Completion, call: _CallDep):
    return await _serve(body, "/v1/completions", call)


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=_CHAT_ANSWERS, openapi_extra=_CHAT_DOC)
@router.post("/v1/openai/v1/chat/completions", response_model=None, include_in_schema=False)
@work
async def create_chat_completion(body: _Chat, call: _CallDep):
    return await _serve(body, "/v1/chat/completions", call)


T = TypeVar("T")

# What a client waiting for an answer gets when this API process is told to stop: the job goes on,
# and the same request again (with its Idempotency-Key) reaches it through another process.
_RESTARTING = (
    "This server is restarting. Your request was stored and goes on as job {job_id}: send it again with the "
    "same Idempotency-Key for its answer, or read it at /v1/jobs/{job_id}."
)


async def _wait_unless_draining(waiting: Coroutine[Any, Any, T], request: Request, job_id: str) -> T:
    """The wait, unless this process starts draining first: then a 503 with Retry-After, answered
    before uvicorn's shutdown timeout would cancel the wait into a 500. It names the stored job
    (`x-spool-job-id`, `Location`): a client that sent no Idempotency-Key reads that job instead of
    sending the request again, which would run it twice."""
    drained: asyncio.Event | None = getattr(request.app.state, "drained", None)
    if drained is None:
        return await waiting
    wait_task = asyncio.ensure_future(waiting)
    drain_task = asyncio.ensure_future(drained.wait())
    try:
        await asyncio.wait({wait_task, drain_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        drain_task.cancel()
    if wait_task.done():
        return wait_task.result()
    wait_task.cancel()
    headers = {"Retry-After": "1", "x-spool-job-id": job_id, "Location": f"/v1/jobs/{job_id}"}
    raise APIError(503, _RESTARTING.format(job_id=job_id), code="server_restarting", headers=headers)


async def _serve(body, endpoint: str, call: _Call):
    """One flow for both endpoints: create the job, then stream it, wait for it, or answer 202."""
    request, principal, redis, hub, settings, lifecycle, completions, fingerprints = call
    queued = "respond-async" in request.headers.get("prefer", "")
    key = request.headers.get("idempotency-key")
    rid = getattr(request.state, "request_id", None)
    small = len(await request.body()) <= INLINE_BYTES  # read already (api/bodies.py): cached
    created = await completions.create(principal, body, key, endpoint, queued=queued, request_id=rid, small=small)
    job, headers, tenant_id = created.job, created.headers, principal.tenant.id
    fingerprint = fingerprints(job.model)
    if queued:
        return _accepted(job, headers, fingerprint)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = sse_chunks(
            job,
            tenant_id,
            redis,
            hub,
            lookup=completions.get,
            include_usage=include_usage,
            fingerprint=fingerprint,
            heavy_cap=settings.replays_per_tenant,
        )
        return _StreamOrCancel(stream, job.id, tenant_id, lifecycle, settings, request.app.state, headers=headers)
    row = await _wait_unless_draining(completions.wait(hub, job, tenant_id, settings.wait_timeout_s), request, job.id)
    if row is None:
        return _accepted(job, headers, fingerprint)
    if row.state == "succeeded":
        return JSONResponse(render.response(row, fingerprint), headers=headers)
    err = render.failure(row)
    return JSONResponse(
        render.envelope(err), status_code=_ERROR_STATUS.get(err["type"], 422), headers={"x-spool-job-id": row.id}
    )


def _accepted(job, headers: dict[str, str], fingerprint: str) -> JSONResponse:
    return JSONResponse(
        render.job(job, fingerprint), status_code=202, headers={"Location": f"/v1/jobs/{job.id}", **headers}
    )


class _StreamOrCancel(EventSourceResponse):
    """The job's stream; if its client went away before reading `[DONE]`, the job is cancelled after
    a grace period unless another reader (a reconnect with Last-Event-ID) follows it by then.

    Judged when the response ends, not inside the generator: a client that hangs up before the first
    byte ends the response before the generator ever runs, so a generator's `finally` never sees it.
    A stream that ended because this server is shutting down, or by an error on our side, cancels
    nothing: the job goes on, and its client can re-attach to /v1/jobs/{id}/events."""

    def __init__(self, stream, job_id: str, tenant_id: int, lifecycle: Lifecycle, settings, state, **kw) -> None:
        self.ended = False
        super().__init__(self._track(stream), **kw)
        self.job_id, self.tenant_id, self.lifecycle = job_id, tenant_id, lifecycle
        self.settings, self.state = settings, state

    async def _track(self, stream):
        async for chunk in stream:
            # A client that closes right after the final `[DONE]` has read everything: nothing to cancel.
            # It ends its write, which may carry the last tokens and the usage chunk before it (a
            # reader that fell behind gets everything in one write).
            self.ended = chunk.endswith(_DONE)
            yield chunk

    async def __call__(self, scope, receive, send) -> None:
        ours = False
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError, asyncio.CancelledError):
            raise  # the client's socket went away, or the server is stopping (judged below)
        except Exception:
            ours = True  # an error on our side: the job goes on
            raise
        finally:
            self._after(ours)

    def _after(self, ours: bool) -> None:
        s = self.settings
        if self.ended or ours or not s.cancel_on_disconnect or getattr(self.state, "draining", False):
            return
        task = asyncio.get_running_loop().create_task(
            _cancel_after_grace(self.lifecycle, self.state.redis, self.job_id, self.tenant_id, s.disconnect_grace_s)
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
