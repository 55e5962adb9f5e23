"""`Idempotency-Key` on creating POSTs (completions, files, batches), per tenant, Stripe's semantics.

The `openai` SDK retries a POST on 408/409/429/5xx and on connection errors. With a key, a retry
gets the original outcome: the same key and the same request (its canonical JSON, hashed) finds
the object the first request created; the same key with another request is a 422; a retry while
the first request is still being created is a 409 (the SDK retries it once that is done). Keys are
kept `idempotency_ttl_h` hours (the retention sweeper removes older ones).

A request that is refused before anything is created (400, 401, 404, 429) releases its key: the same
retry is refused the same way, and a corrected request may reuse it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from core.errors import DomainError, ErrorKind, invalid
from core.infra.db import async_sessions
from core.infra.orm import IdempotencyKey

MAX_KEY = 255
STALE = timedelta(seconds=60)  # an in-flight key this old lost its request


def request_hash(endpoint: str, payload: Any) -> str:
    """The request, canonically: sorted keys, so a re-serialized retry hashes the same."""
    raw = json.dumps({"endpoint": endpoint, "body": payload}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class Claim:
    """A key this request now holds (`replay` None), or the object a first request created."""

    tenant_id: int
    key: str
    replay: str | None = None


async def claim(tenant_id: int, key: str | None, endpoint: str, payload: Any) -> Claim | None:
    """None without a key. Otherwise the key is taken for this request, or the earlier outcome is
    returned (`replay`), or the retry is refused (422 other body, 409 still in flight)."""
    if key is None:
        return None
    if not key or len(key) > MAX_KEY or not key.isprintable():
        raise invalid("Idempotency-Key", f"Idempotency-Key must be 1-{MAX_KEY} printable characters.")
    digest = request_hash(endpoint, payload)
    async with async_sessions()() as session:
        taken = await session.scalar(
            insert(IdempotencyKey)
            .values(tenant_id=tenant_id, key=key, endpoint=endpoint, request_hash=digest)
            .on_conflict_do_nothing()
            .returning(IdempotencyKey.key)
        )
        await session.commit()
        if taken is not None:
            return Claim(tenant_id, key)
        row = await session.get(IdempotencyKey, (tenant_id, key))
    if row is None:  # released between our insert and read: take it on the next retry
        raise DomainError(ErrorKind.conflict, "A request with this Idempotency-Key is in progress.", code="conflict")
    if row.endpoint != endpoint or row.request_hash != digest:
        raise DomainError(
            ErrorKind.unprocessable,
            "Keys for idempotent requests can only be used with the same parameters they were first used with.",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    if row.object_id is None and row.created_at < datetime.now(UTC) - STALE:
        # Its first request died before creating anything (a crash between claim and commit): take over.
        async with async_sessions()() as session:
            await session.execute(
                update(IdempotencyKey)
                .where(IdempotencyKey.tenant_id == tenant_id, IdempotencyKey.key == key)
                .values(created_at=func.now())
            )
            await session.commit()
        return Claim(tenant_id, key)
    if row.object_id is None:
        raise DomainError(
            ErrorKind.conflict,
            "A request with this Idempotency-Key is still in progress; retry shortly.",
            param="Idempotency-Key",
            code="idempotency_in_progress",
        )
    return Claim(tenant_id, key, replay=row.object_id)


async def record(c: Claim | None, object_id: str, session: AsyncSession | None = None) -> None:
    """The object this key's request created (in the caller's transaction when given one)."""
    if c is None or c.replay is not None:
        return
    stmt = (
        update(IdempotencyKey)
        .where(IdempotencyKey.tenant_id == c.tenant_id, IdempotencyKey.key == c.key)
        .values(object_id=object_id)
    )
    if session is not None:
        await session.execute(stmt)
        return
    async with async_sessions()() as s:
        await s.execute(stmt)
        await s.commit()


async def release(c: Claim | None) -> None:
    """Nothing was created: free the key."""
    if c is None or c.replay is not None:
        return
    async with async_sessions()() as s:
        await s.execute(
            delete(IdempotencyKey).where(
                IdempotencyKey.tenant_id == c.tenant_id,
                IdempotencyKey.key == c.key,
                IdempotencyKey.object_id.is_(None),
            )
        )
        await s.commit()


def expired(hours: float):
    """Keys past their retention, for the sweeper."""
    return delete(IdempotencyKey).where(IdempotencyKey.created_at < func.now() - timedelta(hours=hours))


def owner_of(tenant_id: int, key: str):
    return select(IdempotencyKey).where(IdempotencyKey.tenant_id == tenant_id, IdempotencyKey.key == key)
