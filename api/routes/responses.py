"""OpenAI's Responses API: `/v1/responses` create, retrieve (or rejoin its stream), cancel, delete,
and list input items. A response is a chat job (core/jobs/responses.py); this module only chooses
how to answer and frames its stream events as SSE."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker

from api.bodies import INLINE_BYTES, json_body, json_response, openapi_body
from api.costs import OffLoop, cheap, sized, work
from api.deps import LifecycleDep, SettingsDep, SyncSessionsDep, TenantDep, current_principal
from api.errors import APIError
from api.routes.completions import _StreamOrCancel, _wait_unless_draining
from api.sse import HEAVY, ReaderLease, sse_comment
from core.config import Settings
from core.infra import threads
from core.infra.orm import Job
from core.jobs import transitions
from core.jobs.responses import Batch, Responses
from core.protocol import render
from core.protocol import responses as wire
from core.protocol.responses import InputItemList, ResponseDeleted, ResponseObject, ResponsesRequest
from core.protocol.schemas import ErrorResponse

router = APIRouter(prefix="/v1/responses")

_Body = Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))]
_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 429, 503)}


def _answers(model: type[BaseModel], description: str, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses` of a route answering `model` as JSON (its schema in /openapi.json), or with
    `stream` its typed events as SSE."""
    content = {"text/event-stream": {"schema": {"type": "string"}}} if stream else {}
    return {200: {"model": model, "description": description, "content": content}, **_ERRORS}


_OBJECT_OR_STREAM = _answers(
    ResponseObject, "The response object, or its stream events (SSE) with `stream: true`", True
)


async def _responses(request: Request) -> Responses:
    return request.app.state.responses


_ResponsesDep = Annotated[Responses, Depends(_responses)]


def _not_found(resp_id: str) -> APIError:
    return APIError(404, f"Response with id '{resp_id[:128]}' not found.", param="response_id", code="not_found")


def _gate(tenant_id: int, settings: Settings) -> Callable[[], contextlib.AbstractAsyncContextManager[None]]:
    """A rejoined response's backlog is read and rendered inside its tenant's gate, as a job's replay is."""
    return functools.partial(HEAVY.hold, tenant_id, settings.replays_per_tenant)


async def _built(
    tenant_id: int, settings: Settings, build: Callable[..., Any], *args: Any, headers: dict[str, str] | None = None
) -> Response:
    """An object whose size the client set (`instructions`, tools, logprobs, input items) built and
    encoded on the prepare threads, inside its tenant's gate, as a large job object is."""
    async with HEAVY.hold(tenant_id, settings.replays_per_tenant):
        out = await json_response(build, *args)
    out.headers.update(headers or {})
    return out


def _loaded(sessions: sessionmaker[Session], job_id: str, tenant_id: int, resp_id: str) -> Job:
    """The response's row, read on a prepare thread (blocking); a 404 if it was forgotten meanwhile."""
    job = Responses.load(sessions, job_id, tenant_id)
    if job is None:
        raise _not_found(resp_id)
    return job


def _rendered(sessions: sessionmaker[Session], job_id: str, tenant_id: int, resp_id: str) -> dict[str, Any]:
    return render.response_of(_loaded(sessions, job_id, tenant_id, resp_id))


@router.post("", response_model=None, responses=_OBJECT_OR_STREAM, openapi_extra=openapi_body(ResponsesRequest))
@work
async def create_response(
    body: _Body, request: Request, responses: _ResponsesDep, lifecycle: LifecycleDep, settings: SettingsDep
):
    principal = await current_principal(request)
    key = request.headers.get("idempotency-key")
    rid = getattr(request.state, "request_id", None)
    small = len(await request.body()) <= INLINE_BYTES
    created = await responses.create_response(principal, body, key, rid, small)
    job, headers, tenant_id = created.job, created.headers, principal.tenant.id
    if body.stream:
        events = responses.events(request.app.state.hub, job, tenant_id, heavy=_gate(tenant_id, settings))
        stream = _framed(events, request.app.state.redis, job.id)
        if body.background:
            return _Rejoin(stream, headers=headers)
        return _Stream(stream, job.id, tenant_id, lifecycle, settings, request.app.state, headers=headers)
    if body.background:
        return await _built(tenant_id, settings, render.response_of, job, headers=headers)
    waiting = responses.wait(request.app.state.hub, job, tenant_id, settings.wait_timeout_s)
    row = await _wait_unless_draining(waiting, request, job.id)
    return await _built(tenant_id, settings, render.response_of, row if row is not None else job, headers=headers)


@router.get("/{response_id}", response_model=None, responses=_OBJECT_OR_STREAM)
@sized
async def get_response(
    response_id: str,
    request: Request,
    tenant: TenantDep,
    responses: _ResponsesDep,
    settings: SettingsDep,
    sessions: SyncSessionsDep,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1, le=2**53)] = None,
    include: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> OffLoop | _Rejoin:
    """The response as it stands; with `stream=true`, its events (after `starting_after`). Its row,
    which may hold megabytes of input, is read and built on the prepare threads in the tenant's gate."""
    job_id = await responses.exists(response_id, tenant.id)
    if job_id is None:
        raise _not_found(response_id)
    if not stream:
        return OffLoop(tenant.id, _rendered, (sessions, job_id, tenant.id, response_id))
    async with HEAVY.hold(tenant.id, settings.replays_per_tenant):
        job = await threads.run("prepare", Responses.load, sessions, job_id, tenant.id)
    if job is None:
        raise _not_found(response_id)
    events = responses.events(request.app.state.hub, job, tenant.id, starting_after, heavy=_gate(tenant.id, settings))
    return _Rejoin(_framed(events, request.app.state.redis, job.id, live=not transitions.is_terminal(job.state)))


@router.post("/{response_id}/cancel", response_model=None, responses=_answers(ResponseObject, "The response object"))
@sized
async def cancel_response(
    response_id: str, tenant: TenantDep, responses: _ResponsesDep, lifecycle: LifecycleDep, sessions: SyncSessionsDep
) -> OffLoop:
    """Cancels a response that is still running (billed what it generated); an ended one is
    answered as it is. The cancel, the row and the answer all on the prepare threads."""
    job_id = await responses.exists(response_id, tenant.id)
    if job_id is None:
        raise _not_found(response_id)

    def cancelled() -> dict[str, Any]:
        row = lifecycle.cancel(job_id, tenant.id)
        return render.response_of(row) if row is not None else _rendered(sessions, job_id, tenant.id, response_id)

    return OffLoop(tenant.id, cancelled)


@router.delete("/{response_id}", response_model=None, responses=_answers(ResponseDeleted, "The response is forgotten"))
@cheap
async def delete_response(response_id: str, tenant: TenantDep, responses: _ResponsesDep, lifecycle: LifecycleDep):
    """Forgets a stored response (a running one is cancelled first); then every read of it is a 404."""
    job = await responses.find(response_id, tenant.id)
    if job is None:
        raise _not_found(response_id)
    if not transitions.is_terminal(job.state):
        await anyio.to_thread.run_sync(lifecycle.cancel, job.id, tenant.id)
    if not await responses.delete(response_id, tenant.id):
        raise _not_found(response_id)
    return render.response_deleted(render.response_id(job.id))


@router.get(
    "/{response_id}/input_items", response_model=None, responses=_answers(InputItemList, "A page of its input items")
)
@sized
async def list_input_items(
    response_id: str,
    tenant: TenantDep,
    responses: _ResponsesDep,
    sessions: SyncSessionsDep,
    after: Annotated[str | None, Query(max_length=128)] = None,
    before: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> OffLoop:
    job_id = await responses.exists(response_id, tenant.id)
    if job_id is None:
        raise _not_found(response_id)

    def page() -> dict[str, Any]:
        return wire.page(
            wire.input_item_list(_loaded(sessions, job_id, tenant.id, response_id)), after, before, limit, order
        )

    return OffLoop(tenant.id, page)


# -- the stream ------------------------------------------------------------------------------------

_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _frames(events: list[dict[str, Any]]) -> tuple[bytes, bool]:
    """Events as SSE (`event:` its type, `id:` its sequence number), and whether the last is among them."""
    out = bytearray()
    for e in events:
        raw = json.dumps(e, separators=(",", ":"))
        out += format_sse_event(data_str=raw, event=e["type"], id=str(e["sequence_number"]))
    return bytes(out), any(e["type"] in _TERMINAL for e in events)


async def _framed(
    events: AsyncIterator[Batch | object], rds: Any, job_id: str, *, live: bool = True
) -> AsyncIterator[tuple[bytes, bool]]:
    """Batches of events as SSE, with keep-alive comments; each with whether it held the last. A
    batch built off the loop (snapshots, a backlog, the end) is framed off it too. The stream of a
    live job counts as one of its readers."""
    async with ReaderLease(rds, job_id, live=live) as lease:
        async for batch in events:
            await lease.renew()
            if not isinstance(batch, Batch):  # HEARTBEAT
                yield sse_comment("keep-alive"), False
                continue
            frame, last = await threads.run("prepare", _frames, batch.events) if batch.heavy else _frames(batch.events)
            if frame:
                yield frame, last


async def _bytes(stream: AsyncIterator[tuple[bytes, bool]]) -> AsyncIterator[bytes]:
    async for frame, _ in stream:
        yield frame


class _Rejoin(EventSourceResponse):
    """A stream nobody cancels by leaving: a background response's, or a rejoin of any."""

    def __init__(self, stream: AsyncIterator[tuple[bytes, bool]], **kw: Any) -> None:
        super().__init__(_bytes(stream), **kw)


class _Stream(_StreamOrCancel):
    """The creating request's stream: its job is cancelled when its client goes away before the
    last event, after the grace period, unless another reader follows it by then (chat's rule)."""

    async def _track(self, stream):
        async for frame, last in stream:
            self.ended = last
            yield frame
