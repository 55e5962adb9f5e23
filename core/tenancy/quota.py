"""What a tenant stores, per store, and the quotas on it (issue 49): every byte kept for a tenant is
counted to it and bounded by its limits.

- `jobs`: its jobs' and batches' rows in Postgres (requests, Responses input items, instructions and
  tools, results), each row's `stored_bytes` written by triggers and summed per tenant in
  `tenant_stored` by the same statements (migration 0014): reading a tenant's total is one index
  range of at most 16 rows, whatever the number of jobs. Quota: `max_stored_bytes`, else
  `SPOOL_TENANT_STORED_BYTES`; a request that would pass it is a 413 `storage_quota_exceeded`
  before anything is stored, a batch that would is failed at validation.
- `files`: its uploads (core/files/service.py keeps that quota, `max_storage_bytes`).
- `redis`: what its ended jobs hold in Redis (core/tenancy/usage.py). Quota: `max_redis_bytes`, else
  `SPOOL_TENANT_REDIS_BYTES_LIMIT`; at it, new requests are a 429 `redis_quota_exceeded` until the
  keys expire. A job's Redis bytes are only known as it ends, so the check is "already at the limit",
  not "would pass it".

A tenant's limit NULL means the deployment's default, 0 no limit.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.config import Settings
from core.errors import DomainError, ErrorKind
from core.infra import transient
from core.infra.orm import File, TenantStored
from core.states import FileStatus
from core.tenancy import usage

STORES = ("jobs", "files", "redis")
# A tenant whose count was read this recently and is this far under its limit is admitted on that
# count: one read per tenant per second, not per request. Near the limit every request reads it again.
FRESH_S = 1.0
# Spool-written files (batch output) count to no quota (core/files/service.WRITTEN_BY_SPOOL).
_SPOOL_WRITTEN = "batch_output"


def limit(own: int | None, default: int) -> int:
    """A tenant's effective limit: its own, else the deployment's; 0 means none."""
    return default if own is None else own


def stored_limit(t: Any, settings: Settings) -> int:
    return limit(t.max_stored_bytes, settings.tenant_stored_bytes)


def redis_limit(t: Any, settings: Settings) -> int:
    return limit(t.max_redis_bytes, settings.tenant_redis_bytes_limit)


def json_bytes(*values: Any) -> int:
    """What `values` will store, in bytes: the request side of a job's `stored_bytes`, written as
    Postgres writes a jsonb value out (`, ` and `: ` separators, UTF-8), which is what it counts."""
    return sum(len(json.dumps(v, ensure_ascii=False).encode()) for v in values if v is not None)


def stored_of(tenant_id: int) -> Select:
    """A tenant's stored bytes in jobs and batches (its slots summed)."""
    return select(func.coalesce(func.sum(TenantStored.bytes), 0)).where(TenantStored.tenant_id == tenant_id)


def stored_all() -> Select:
    """(tenant_id, bytes) of every tenant with stored rows."""
    return select(TenantStored.tenant_id, func.sum(TenantStored.bytes)).group_by(TenantStored.tenant_id)


def _files_live() -> Any:
    """Files that count: kept (not deleted), or uploads still in progress."""
    return and_(
        File.purpose != _SPOOL_WRITTEN,
        or_(File.deleted.is_(False), and_(File.status == FileStatus.uploading.value, File.expires_at > func.now())),
    )


def files_of(tenant_id: int) -> Select:
    """A tenant's bytes of files against its `max_storage_bytes` (what core/files/service.Upload checks)."""
    return select(func.coalesce(func.sum(File.bytes), 0)).where(File.tenant_id == tenant_id, _files_live())


def files_all() -> Select:
    return select(File.tenant_id, func.sum(File.bytes)).where(_files_live()).group_by(File.tenant_id)


def too_much_stored(quota: int, used: int, need: int) -> DomainError:
    """The 413 of a request whose storing would pass the tenant's stored-bytes quota, naming it."""
    return DomainError(
        ErrorKind.too_large,
        f"Storage quota exceeded: this organization may keep {quota} bytes of stored requests and results "
        f"(max_stored_bytes); {used} are stored and this request needs {need} more. Delete stored responses "
        "you no longer need, or wait for old jobs to be removed.",
        code="storage_quota_exceeded",
    )


def redis_full(quota: int, held: int, ended_ttl_s: int) -> DomainError:
    """The 429 of a tenant whose ended jobs hold its whole Redis quota; retry when the oldest counted
    window of them has expired."""
    w = max(1, ended_ttl_s)
    retry = w - int(time.time()) % w
    return DomainError(
        ErrorKind.rate_limited,
        f"Redis quota reached: this organization's ended jobs hold {held} bytes of Redis (streams and marks), "
        f"its limit is {quota} (max_redis_bytes). They expire within {ended_ttl_s}s; please try again in {retry}s.",
        type_="requests",
        code="redis_quota_exceeded",
        headers={"retry-after": str(retry)},
    )


@dataclass
class _Seen:
    stored: int
    redis: int
    at: float


class Quotas:
    """Admission's check of a tenant's stored bytes (Postgres) and Redis bytes, before anything of a
    request is stored. Concurrent requests of one tenant may together pass the limit by what they are
    storing at that moment (no reservation: that would serialize a tenant's submissions); the next
    request sees them."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], rds: Any, settings: Settings) -> None:
        self.sessions, self.redis, self.settings = sessions, rds, settings
        self._seen: dict[int, _Seen] = {}

    async def check(self, tenant: Any, need: int) -> None:
        """Raise the 413 or 429 that refuses a request storing `need` bytes; None when it fits."""
        pg, rq = stored_limit(tenant, self.settings), redis_limit(tenant, self.settings)
        if not pg and not rq:
            return
        seen = self._seen.get(tenant.id)
        now = time.monotonic()
        if seen is None or now - seen.at > FRESH_S or (pg and seen.stored + need > pg) or (rq and seen.redis >= rq):
            seen = _Seen(await self._stored(tenant.id) if pg else 0, await self._redis(tenant.id) if rq else 0, now)
            self._seen[tenant.id] = seen
            if len(self._seen) > 10_000:  # tenants seen long ago: forgotten
                self._seen = {k: v for k, v in self._seen.items() if now - v.at <= FRESH_S}
        if pg and seen.stored + need > pg:
            raise too_much_stored(pg, seen.stored, need)
        if rq and seen.redis >= rq:
            raise redis_full(rq, seen.redis, self.settings.ended_events_ttl_s)
        seen.stored += need  # this process's own admissions count until the next read

    async def _stored(self, tenant_id: int) -> int:
        async with self.sessions() as s:
            return int((await s.execute(stored_of(tenant_id))).scalar() or 0)

    async def _redis(self, tenant_id: int) -> int:
        return await usage.tenant_redis_bytes(self.redis, self.settings.ended_events_ttl_s, tenant_id)


async def tenant_stored(
    session: AsyncSession, rds: Any, tenant: Any, settings: Settings, redis_away: type[BaseException] | tuple = ()
) -> tuple[dict[str, int | None], dict[str, int]]:
    """One tenant's bytes per store (`redis` None when Redis raised one of `redis_away`), and its
    limit on each (0: none)."""
    jobs = int((await session.execute(stored_of(tenant.id))).scalar() or 0)
    files = int((await session.execute(files_of(tenant.id))).scalar() or 0)
    try:
        redis: int | None = await usage.tenant_redis_bytes(rds, settings.ended_events_ttl_s, tenant.id)
    except redis_away:
        redis = None
    limits = {
        "jobs": stored_limit(tenant, settings),
        "files": tenant.max_storage_bytes or settings.tenant_storage_bytes,
        "redis": redis_limit(tenant, settings),
    }
    return {"jobs": jobs, "files": files, "redis": redis}, limits


def all_stored(
    session: Any, rds: Any, ended_ttl_s: int, tenant_id: int | None = None
) -> dict[int, dict[str, int | None]]:
    """Every tenant's bytes per store (sync: the dispatcher's gauges, /admin/usage): tenant id ->
    {store: bytes}, tenants storing nothing left out."""
    out: dict[int, dict[str, int | None]] = {}
    jobs, files = stored_all(), files_all()
    if tenant_id is not None:
        jobs = jobs.where(TenantStored.tenant_id == tenant_id)
        files = files.where(File.tenant_id == tenant_id)
    for store, rows in (("jobs", session.execute(jobs).all()), ("files", session.execute(files).all())):
        for t, n in rows:
            out.setdefault(int(t), {})[store] = int(n or 0)
    try:
        held: dict[int, int] | None = usage.redis_bytes(rds, ended_ttl_s)
    except transient.REDIS:
        held = None  # Redis away: its counts are unknown, the others still answer
    for t, n in (held or {}).items():
        if tenant_id is None or t == tenant_id:
            out.setdefault(t, {})["redis"] = n
    for counts in out.values():
        for store in STORES:
            counts.setdefault(store, 0 if held is not None or store != "redis" else None)
    return out


def over_stored_batch(cur: Any, tenant_id: int, batch_id: str, settings: Settings) -> dict[str, Any] | None:
    """A batch's error entry when its lines, just inserted in the validator's transaction (psycopg
    cursor `cur`), took the tenant past its stored-bytes quota: the batch fails, its transaction is
    rolled back and nothing stays stored. None when it fits."""
    cur.execute("SELECT max_stored_bytes FROM tenants WHERE id = %s", (tenant_id,))
    row = cur.fetchone()
    quota = limit(row[0] if row else None, settings.tenant_stored_bytes)
    if not quota:
        return None
    cur.execute("SELECT coalesce(sum(bytes), 0) FROM tenant_stored WHERE tenant_id = %s", (tenant_id,))
    total = int(cur.fetchone()[0])
    if total <= quota:
        return None
    cur.execute("SELECT coalesce(sum(stored_bytes), 0) FROM jobs WHERE batch_id = %s", (batch_id,))
    mine = int(cur.fetchone()[0])
    return {
        "code": "storage_quota_exceeded",
        "message": f"Storage quota exceeded: this batch's lines need {mine} bytes stored and {total - mine} are "
        f"stored already; this organization may keep {quota} bytes of stored requests and results "
        "(max_stored_bytes). Delete stored responses you no longer need, or split the batch.",
        "param": None,
        "line": None,
    }
