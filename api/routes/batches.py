"""OpenAI's Batches API over Spool's jobs: each input line is a job of kind 'batch'."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from api.costs import Body, OffLoop, cheap, sized, work
from api.deps import (
    IdempotencyDep,
    PrincipalDep,
    RedisDep,
    SessionDep,
    SettingsDep,
    SyncSessionsDep,
    TenantDep,
)
from core.batches import service
from core.protocol.schemas import BatchList, BatchObject

router = APIRouter(prefix="/v1/batches")


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    webhook_url: Annotated[str, Field(max_length=2048, pattern=r"^https?://")] | None = None
    # {"anchor": "created_at", "seconds": N}: checked by the service (core/files/expiry.py).
    output_expires_after: dict[str, Any] | None = None


@router.post("", response_model=BatchObject)
@work(body=Body.SMALL)
async def create_batch(
    body: BatchCreate,
    request: Request,
    principal: PrincipalDep,
    session: SessionDep,
    redis: RedisDep,
    settings: SettingsDep,
    keys: IdempotencyDep,
) -> dict:
    key = request.headers.get("idempotency-key")
    # A request without output_expires_after hashes as it did before that field existed.
    unset = {"output_expires_after"} if body.output_expires_after is None else None
    payload = body.model_dump(mode="json", exclude=unset)
    async with keys.held(principal.tenant.id, key, "/v1/batches", payload) as claim:
        if claim is not None and claim.replay is not None:
            return await service.view(session, await service.get(session, claim.replay, principal.tenant.id))
        rid = getattr(request.state, "request_id", None)
        b = await service.create(session, redis, principal, settings, **body.model_dump(), claim=claim, request_id=rid)
    return await service.view(session, b)


# Lists and retrievals are read, rendered and encoded on the prepare threads (api/bodies.json_response):
# metadata the client sent is decoded and encoded there, never on the event loop.
@router.get("", response_model=BatchList)
@sized
async def list_batches(
    tenant: TenantDep, sessions: SyncSessionsDep, limit: int = 20, after: str | None = None
) -> OffLoop:
    return OffLoop(tenant.id, service.list_page, (sessions, tenant.id, max(1, min(limit, 100)), after))


@router.get("/{batch_id}", response_model=BatchObject)
@sized
async def get_batch(batch_id: str, tenant: TenantDep, sessions: SyncSessionsDep) -> OffLoop:
    return OffLoop(tenant.id, service.retrieve, (sessions, batch_id, tenant.id))


@router.post("/{batch_id}/cancel", response_model=BatchObject)
@cheap
async def cancel_batch(batch_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    return await service.view(session, await service.cancel(session, batch_id, tenant.id))
