"""The Batches API's use cases: create, read, list, cancel. Validation itself is ingest.py's, run
by the dispatcher process (never the API: a million-line file must not share the API's CPU)."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

import anyio
import redis.asyncio as aioredis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, sessionmaker

from core import idempotency
from core.batches import progress, webhooks
from core.batches.transitions import CANCELLABLE, EMPTY_COUNTS, cancel_requested
from core.config import Settings
from core.errors import DomainError, ErrorKind, invalid, not_found
from core.files import expiry
from core.files import storage as files
from core.idempotency import Claim
from core.infra import redis_keys, threads
from core.infra.orm import Batch
from core.protocol import render
from core.protocol.schemas import metadata_problem
from core.states import BatchStatus
from core.tenancy.keys import Principal

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
WAKE_TIMEOUT_S = 2.0  # the wake-up may hold a created batch's answer this long at most


def _not_found(batch_id: str) -> DomainError:
    return not_found(f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")


async def get(session: AsyncSession, batch_id: str, tenant_id: int) -> Batch:
    b = (await session.execute(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))).scalar()
    if b is None:
        raise _not_found(batch_id)
    return b


async def view(session: AsyncSession, b: Batch) -> dict[str, Any]:
    """The batch object (its counts are kept on the row as lines end: nothing to count here)."""
    return progress.batch_json(b)


async def create(
    session: AsyncSession,
    rds: aioredis.Redis,
    principal: Principal,
    settings: Settings,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    webhook_url: str | None,
    output_expires_after: dict[str, Any] | None = None,
    claim: Claim | None = None,
    request_id: str | None = None,
) -> Batch:
    if endpoint not in ENDPOINTS:
        raise invalid("endpoint", f"Unsupported endpoint '{endpoint}': Spool batches {sorted(ENDPOINTS)}.")
    window_problem = progress.window_problem(completion_window)  # 1 s to progress.MAX_WINDOW_S
    if window_problem is not None:
        raise invalid("completion_window", window_problem)
    output_expires_s = expiry.seconds_of(output_expires_after, "output_expires_after")
    meta_problem = metadata_problem(metadata)  # OpenAI's limits: 16 pairs, keys 64, values 512 characters
    if meta_problem is not None:
        raise invalid("metadata", meta_problem)
    if webhook_url:
        try:
            # A DNS lookup, on its own threads, within the tenant's share of them and the webhook deadline.
            with anyio.fail_after(settings.webhook_timeout_s):
                await threads.run("dns", webhooks.check_url, webhook_url, settings)
        except webhooks.RefusedAddress as exc:
            raise invalid("webhook_url", str(exc), "invalid_webhook_url") from None
        except TimeoutError:
            why = f"webhook_url's host does not resolve within {settings.webhook_timeout_s:g} s."
            raise invalid("webhook_url", why, "invalid_webhook_url") from None
    f = (await session.execute(files.get_for_tenant(input_file_id, principal.tenant.id))).scalar()
    if f is None:
        raise not_found(f"No such File object: {input_file_id}", param="input_file_id", code="file_not_found")
    if f.purpose != "batch":
        raise invalid("input_file_id", "The input file's purpose must be 'batch'.")
    now = datetime.now(UTC)
    b = Batch(
        id=progress.new_batch_id(),
        tenant_id=principal.tenant.id,
        key_id=principal.key.id,
        endpoint=endpoint,
        input_file_id=f.id,
        completion_window=completion_window,
        status=BatchStatus.validating.value,
        meta=metadata,
        webhook_url=webhook_url,
        output_expires_s=output_expires_s,
        request_id=request_id,
        created_at=now,
        expires_at=progress.expires_at(now, completion_window),
        request_counts=dict(EMPTY_COUNTS),
    )
    session.add(b)
    await idempotency.record(claim, b.id, session)
    await session.commit()
    await _wake_validator(rds, b.id)
    return b


async def _wake_validator(rds: aioredis.Redis, batch_id: str) -> None:
    """Wake a validator now rather than at its next poll: best-effort, after the commit. The batch
    is stored, so nothing here may turn the answer into an error: a 503 made the SDK retry and
    create a second batch. A validator that misses the wake finds the batch at its next poll."""
    try:
        async with asyncio.timeout(WAKE_TIMEOUT_S):
            await rds.lpush(redis_keys.BATCH_VALIDATE_WAKE, batch_id)
    except Exception as exc:  # Redis away, slow or refusing: the poll picks the batch up
        log.warning("batch %s stored; could not wake a validator (%s): it starts at the next poll", batch_id, exc)


# Reads whose answer's size the client controls (metadata): synchronous, for a thread
# (api/bodies.json_response), so the rows are decoded and rendered off the API's event loop.
def list_page(sessions: sessionmaker[Session], tenant_id: int, limit: int, after: str | None) -> dict[str, Any]:
    """A page of the tenant's batches, newest first, as OpenAI's list object."""
    with sessions() as s:
        stmt = select(Batch).where(Batch.tenant_id == tenant_id)
        if after:
            cursor = s.scalar(select(Batch.created_at).where(Batch.id == after, Batch.tenant_id == tenant_id))
            if cursor is not None:
                stmt = stmt.where(Batch.created_at < cursor)
        rows = s.scalars(stmt.order_by(Batch.created_at.desc()).limit(limit + 1)).all()
        return render.page([progress.batch_json(b) for b in rows[:limit]], len(rows) > limit)


def retrieve(sessions: sessionmaker[Session], batch_id: str, tenant_id: int) -> dict[str, Any]:
    """One batch object of the tenant's (a 404 for anyone else's)."""
    with sessions() as s:
        b = s.scalar(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))
        if b is None:
            raise _not_found(batch_id)
        return progress.batch_json(b)


async def cancel(session: AsyncSession, batch_id: str, tenant_id: int) -> Batch:
    b = await get(session, batch_id, tenant_id)
    if b.status in CANCELLABLE:
        await session.execute(cancel_requested(batch_id, datetime.now(UTC)))
        await session.commit()
        await session.refresh(b)
    elif b.status not in (BatchStatus.cancelling, BatchStatus.cancelled):
        raise DomainError(
            ErrorKind.conflict, f"Cannot cancel a batch that is {b.status}.", param="batch_id", code="invalid_state"
        )
    return b
