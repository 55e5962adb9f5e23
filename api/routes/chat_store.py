"""OpenAI's stored chat completions: retrieve, list, update the metadata of, delete, and list the
messages of a chat completion created with `store: true` (core/jobs/chat_store.py decides what is
stored and when; this module only reads the request). Each answer but a deletion's is read and built
on the prepare threads inside the tenant's gate (a completion, its messages and a page of them are the
client's size); a deletion, one small UPDATE, on a worker thread."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict

from api.costs import OffLoop, cheap, sized
from api.deps import FingerprintsDep, TenantDep
from core.jobs.chat_store import StoredChats, metadata_filter
from core.protocol.schemas import (
    ChatCompletionDeleted,
    ErrorResponse,
    Metadata,
    StoredChatCompletion,
    StoredChatCompletionList,
    StoredChatMessageList,
)

router = APIRouter(prefix="/v1/chat/completions")

_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 429)}


def _answers(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """`responses` of a route answering `model` as JSON (its schema in /openapi.json): the handlers
    return bodies built off the loop, which a `response_model` would validate again on it."""
    return {200: {"model": model, "description": description}, **_ERRORS}


_After = Annotated[str | None, Query(max_length=128)]
_Limit = Annotated[int, Query(ge=1, le=100)]


async def _stored(request: Request) -> StoredChats:
    return StoredChats(request.app.state.sync_sessions)


_StoredDep = Annotated[StoredChats, Depends(_stored)]


class CompletionUpdate(BaseModel):
    """`POST /v1/chat/completions/{id}`'s body: metadata is the only field OpenAI lets one change."""

    model_config = ConfigDict(extra="forbid")
    metadata: Metadata | None


@router.get("", response_model=None, responses=_answers(StoredChatCompletionList, "A page of them"))
@sized
async def list_chat_completions(
    request: Request,
    tenant: TenantDep,
    stored: _StoredDep,
    fingerprints: FingerprintsDep,
    after: _After = None,
    limit: _Limit = 20,
    order: Literal["asc", "desc"] = "asc",
    model: Annotated[str | None, Query(max_length=256)] = None,
) -> OffLoop:
    """The tenant's stored chat completions; `metadata[key]=value` pairs filter them (all must match)."""
    metadata = metadata_filter(request.query_params)

    def page() -> dict[str, Any]:
        return stored.page(
            tenant.id, fingerprints, after=after, limit=limit, order=order, metadata=metadata, model=model
        )

    return OffLoop(tenant.id, page)


@router.get("/{completion_id}", response_model=None, responses=_answers(StoredChatCompletion, "The completion"))
@sized
async def get_chat_completion(
    completion_id: str, tenant: TenantDep, stored: _StoredDep, fingerprints: FingerprintsDep
) -> OffLoop:
    return OffLoop(tenant.id, stored.retrieve, (completion_id, tenant.id, fingerprints))


@router.post("/{completion_id}", response_model=None, responses=_answers(StoredChatCompletion, "The completion"))
@sized
async def update_chat_completion(
    completion_id: str, body: CompletionUpdate, tenant: TenantDep, stored: _StoredDep, fingerprints: FingerprintsDep
) -> OffLoop:
    return OffLoop(tenant.id, stored.update, (completion_id, tenant.id, body.metadata, fingerprints))


@router.delete("/{completion_id}", response_model=None, responses=_answers(ChatCompletionDeleted, "It is deleted"))
@cheap
async def delete_chat_completion(completion_id: str, tenant: TenantDep, stored: _StoredDep) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(stored.delete, completion_id, tenant.id)


@router.get(
    "/{completion_id}/messages",
    response_model=None,
    responses=_answers(StoredChatMessageList, "A page of its messages"),
)
@sized
async def list_chat_completion_messages(
    completion_id: str,
    tenant: TenantDep,
    stored: _StoredDep,
    after: _After = None,
    limit: _Limit = 20,
    order: Literal["asc", "desc"] = "asc",
) -> OffLoop:
    return OffLoop(tenant.id, lambda: stored.messages(completion_id, tenant.id, after=after, limit=limit, order=order))
