"""`Idempotency-Key` on creating POSTs (completions, chat, responses, files, batches), per tenant, Stripe's semantics.

The `openai` SDK retries a POST on 408/409/429/5xx and on connection errors. With a key, a retry
gets the original outcome: the same key and the same request (its fingerprint: the canonical JSON
of the whole request, hashed; a file's content hash included) finds the object the first request
created; the same key with another request is a 422; a retry while the first request is still
creating is a 409 (the SDK retries it once that is done). Keys are kept `idempotency_ttl_h` hours
(the retention sweeper removes older ones).

Each of those routes goes through `Idempotency.held` (/admin's creating POSTs take no key): it takes
the key, keeps it while the request works, and frees it when nothing was created. Taking the key is
one compare-and-set in SQL on the database's clock: a new key is inserted, and a key whose holder
stopped renewing it for `idempotency_lock_s` (its request died) is taken over by exactly one retry,
however many arrive at once. The holder renews its hold every third of that while it works (a long
upload is not mistaken for a dead one), and records its object only while it still holds the key
(its random token): a holder that was paused past its hold and taken over creates nothing, and
answers 409.

A request that is refused before anything is created (400, 401, 404, 429) releases its key: the same
retry is refused the same way, and a corrected request may reuse it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Update, and_, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.errors import DomainError, ErrorKind, invalid
from core.infra.orm import IdempotencyKey

log = logging.getLogger(__name__)

MAX_KEY = 255
K = IdempotencyKey


def request_hash(endpoint: str, payload: Any) -> str:
    """The request, canonically: sorted keys, so a re-serialized retry hashes the same."""
    raw = json.dumps({"endpoint": endpoint, "body": payload}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class Claim:
    """A key this request now holds (`token`, `replay` None), or the object a first request created."""

    tenant_id: int
    key: str
    replay: str | None = None
    token: str | None = None


def in_progress() -> DomainError:
    return DomainError(
        ErrorKind.conflict,
        "A request with this Idempotency-Key is still in progress; retry shortly.",
        param="Idempotency-Key",
        code="idempotency_in_progress",
    )


def _take(tenant_id: int, key: str, endpoint: str, digest: str, token: str, hold: timedelta):
    """Insert the key, or take over a key nobody holds any more (no object, hold lapsed, same
    request): one statement, so of simultaneous retries exactly one gets a row back."""
    stmt = insert(K).values(
        tenant_id=tenant_id,
        key=key,
        endpoint=endpoint,
        request_hash=digest,
        lock_token=token,
        locked_until=func.now() + hold,
    )
    ex = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[K.tenant_id, K.key],
        set_={"lock_token": ex.lock_token, "locked_until": ex.locked_until, "created_at": func.now()},
        where=and_(
            K.object_id.is_(None),
            K.locked_until < func.now(),
            K.endpoint == ex.endpoint,
            K.request_hash == ex.request_hash,
        ),
    ).returning(K.lock_token)


def _is(tenant_id: int, key: str) -> tuple[Any, ...]:
    return (K.tenant_id == tenant_id, K.key == key)


def _mine(c: Claim) -> tuple[Any, ...]:
    return (*_is(c.tenant_id, c.key), K.lock_token == c.token, K.object_id.is_(None))


def record_statement(c: Claim | None, object_id: str) -> Update | None:
    """The UPDATE that names the key's object, for the transaction that creates it (sync or async):
    it matches only while this request still holds the key. No row back: the creation must be
    rolled back (`in_progress()`). None when there is nothing to record."""
    if c is None or c.replay is not None:
        return None
    return update(K).where(*_mine(c)).values(object_id=object_id, lock_token=None, locked_until=None).returning(K.key)


async def record(c: Claim | None, object_id: str, session: AsyncSession) -> None:
    """Name the object this key's request created, in the caller's transaction. Raises (409) when
    the request no longer holds the key: the caller must not commit."""
    stmt = record_statement(c, object_id)
    if stmt is not None and (await session.execute(stmt)).first() is None:
        raise in_progress()


class Idempotency:
    """Taking, holding and releasing keys, on the sessions and the hold (`idempotency_lock_s`) it is
    given: the API builds one at startup (api/app.py)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], lock_s: float) -> None:
        self.sessions, self.lock_s = sessions, lock_s

    async def claim(self, tenant_id: int, key: str | None, endpoint: str, payload: Any) -> Claim | None:
        """None without a key. Otherwise the key is taken for this request, or the earlier outcome is
        returned (`replay`), or the retry is refused (422 other request, 409 still in flight)."""
        if key is None:
            return None
        if not key or len(key) > MAX_KEY or not key.isprintable():
            raise invalid("Idempotency-Key", f"Idempotency-Key must be 1-{MAX_KEY} printable characters.")
        digest = request_hash(endpoint, payload)
        token = secrets.token_hex(16)
        row = None
        async with self.sessions() as session:
            taken = await session.scalar(_take(tenant_id, key, endpoint, digest, token, self._hold()))
            if taken is None:
                row = (
                    await session.execute(select(K.endpoint, K.request_hash, K.object_id).where(*_is(tenant_id, key)))
                ).first()
            await session.commit()
        if taken is not None:
            return Claim(tenant_id, key, token=token)
        if row is None:  # released between our insert and read: take it on the next retry
            raise in_progress()
        if row.endpoint != endpoint or row.request_hash != digest:
            raise DomainError(
                ErrorKind.unprocessable,
                "Keys for idempotent requests can only be used with the same parameters they were first used with.",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        if row.object_id is None:
            raise in_progress()
        return Claim(tenant_id, key, replay=row.object_id)

    def _hold(self) -> timedelta:
        return timedelta(seconds=self.lock_s)

    async def renew(self, c: Claim) -> bool:
        """Extend this request's hold; False when it has none any more (a retry took the key over)."""
        async with self.sessions() as session:
            got = await session.scalar(
                update(K).where(*_mine(c)).values(locked_until=func.now() + self._hold()).returning(K.key)
            )
            await session.commit()
        return got is not None

    async def release(self, c: Claim | None) -> None:
        """Nothing was created: free the key (only if this request still holds it)."""
        if c is None or c.replay is not None:
            return
        async with self.sessions() as s:
            await s.execute(delete(K).where(*_mine(c)))
            await s.commit()

    async def _keep(self, c: Claim, every_s: float) -> None:
        """Renew the hold every `every_s` until cancelled (or until it is lost: the record will fail)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                if not await self.renew(c):
                    log.warning("Idempotency-Key %r was taken over by a retry; this request will create nothing", c.key)
                    return
            except Exception as exc:  # the database away: keep trying; the hold may lapse meanwhile
                log.warning("could not renew Idempotency-Key %r: %s", c.key, type(exc).__name__)

    @asynccontextmanager
    async def held(self, tenant_id: int, key: str | None, endpoint: str, payload: Any) -> AsyncIterator[Claim | None]:
        """The one way a create route uses a key: `claim` it (None without a key; a replay's Claim
        names the earlier object), hold it while the body runs (renewed every third of the hold),
        and release it if the body raises before anything was recorded. The body records its object
        with `record` / `record_statement` in the transaction that creates it."""
        c = await self.claim(tenant_id, key, endpoint, payload)
        if c is None or c.replay is not None:
            yield c
            return
        keeper = asyncio.create_task(self._keep(c, self.lock_s / 3))
        try:
            yield c
        except BaseException:
            keeper.cancel()
            await asyncio.shield(self.release(c))  # nothing stored (a recorded key is not released)
            raise
        finally:
            keeper.cancel()


def expired(hours: float):
    """Keys past their retention, for the sweeper."""
    return delete(IdempotencyKey).where(IdempotencyKey.created_at < func.now() - timedelta(hours=hours))
