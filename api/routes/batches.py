"""OpenAI's Batches API over Spool's jobs: each input line is a job of kind 'batch'."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select, update

from api.deps import PrincipalDep, SessionDep, SettingsDep, TenantDep
from api.errors import APIError
from api.schemas import page
from core import batches, files
from core.models import Batch

router = APIRouter(prefix="/v1/batches")
ENDPOINTS = {"/v1/completions"}


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    webhook_url: Annotated[str, Field(max_length=2048, pattern=r"^https?://")] | None = None


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")


async def _get(session, batch_id: str, tenant_id: int) -> Batch:
    b = (await session.execute(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))).scalar()
    if b is None:
        raise _not_found(batch_id)
    return b


async def _body(session, b: Batch) -> dict[str, Any]:
    counts = None
    if b.status in ("in_progress", "cancelling", "finalizing"):  # live, straight from the jobs
        counts, _ = batches.summarize((await session.execute(batches.state_counts(session, b.id))).all())
    return batches.batch_json(b, counts)


@router.post("")
async def create_batch(
    body: BatchCreate, request: Request, principal: PrincipalDep, session: SessionDep, settings: SettingsDep
) -> dict:
    if body.endpoint not in ENDPOINTS:
        raise APIError(
            400,
            f"Unsupported endpoint '{body.endpoint}': Spool batches {sorted(ENDPOINTS)}.",
            param="endpoint",
            code="invalid_value",
        )
    if batches.window_seconds(body.completion_window) is None:
        raise APIError(
            400,
            "completion_window must be '24h' (or a duration like '30m', '2h').",
            param="completion_window",
            code="invalid_value",
        )
    if body.webhook_url and not settings.webhook_secret:
        raise APIError(
            400,
            "This deployment signs no webhooks (SPOOL_WEBHOOK_SECRET is unset), so 'webhook_url' cannot be used.",
            param="webhook_url",
            code="webhooks_disabled",
        )
    f = (await session.execute(files.get_for_tenant(body.input_file_id, principal.tenant.id))).scalar()
    if f is None:
        raise APIError(404, f"No such File object: {body.input_file_id}", param="input_file_id", code="file_not_found")
    if f.purpose != "batch":
        raise APIError(400, "The input file's purpose must be 'batch'.", param="input_file_id", code="invalid_value")
    now = datetime.now(UTC)
    b = Batch(
        id=batches.new_batch_id(),
        tenant_id=principal.tenant.id,
        key_id=principal.key.id,
        endpoint=body.endpoint,
        input_file_id=f.id,
        completion_window=body.completion_window,
        status="validating",
        meta=body.metadata,
        webhook_url=body.webhook_url,
        created_at=now,
        expires_at=batches.expires_at(now, body.completion_window),
        request_counts={"total": 0, "completed": 0, "failed": 0},
    )
    session.add(b)
    await session.commit()
    request.app.state.validate_now.set()
    return batches.batch_json(b)


@router.get("")
async def list_batches(tenant: TenantDep, session: SessionDep, limit: int = 20, after: str | None = None) -> dict:
    limit = max(1, min(limit, 100))
    stmt = select(Batch).where(Batch.tenant_id == tenant.id)
    if after:
        cursor = (await session.execute(select(Batch).where(Batch.id == after, Batch.tenant_id == tenant.id))).scalar()
        if cursor is not None:
            stmt = stmt.where(Batch.created_at < cursor.created_at)
    rows = (await session.execute(stmt.order_by(Batch.created_at.desc()).limit(limit + 1))).scalars().all()
    data = [await _body(session, b) for b in rows[:limit]]
    return page(data, len(rows) > limit)


@router.get("/{batch_id}")
async def get_batch(batch_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    return await _body(session, await _get(session, batch_id, tenant.id))


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    b = await _get(session, batch_id, tenant.id)
    if b.status in ("validating", "in_progress"):
        await session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_(["validating", "in_progress"]))
            .values(status="cancelling", cancelling_at=datetime.now(UTC))
        )
        await session.commit()
        await session.refresh(b)
    elif b.status not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch that is {b.status}.", param="batch_id", code="invalid_state")
    return await _body(session, b)
