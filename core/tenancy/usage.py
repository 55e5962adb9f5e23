"""Usage accounting: every finished job counts once in `usage_daily`, plus Prometheus counters.

`usage_daily` has one row per day, tenant, key, model and service tier: a finished job adds 1 to its `requests`
(and to `failed` unless it succeeded) and its tokens. Called in the same transaction as the job's
terminal transition, by whoever makes it (worker, API cancel, dispatcher reaper, batch keeper), so
billing and job state cannot disagree. Many jobs that end together (a batch's expired lines) are
added per (tenant, key, model) with `requests` = how many: one upsert per group, not per job.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import BigInteger, Select, Table, Update, bindparam, func, literal, select
from sqlalchemy.dialects.postgresql import Insert, insert

from core.infra import redis_keys
from core.infra.metrics import REQUESTS, SECONDS, TIERS, TOKENS
from core.infra.orm import UsageDaily
from core.infra.streams import write
from core.states import Ending

_TABLE = cast(Table, UsageDaily.__table__)
_DAY = func.date(func.timezone("utc", func.now()))
_COLUMNS = (
    "tenant_id",
    "key_id",
    "model",
    "service_tier",
    "requests",
    "failed",
    "prompt_tokens",
    "completion_tokens",
    "gpu_seconds",
)


def _on_conflict(stmt: Insert) -> Insert:
    t, ex = _TABLE, stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[t.c.day, t.c.tenant_id, t.c.key_id, t.c.model, t.c.service_tier],
        set_={
            "requests": t.c.requests + ex.requests,
            "failed": t.c.failed + ex.failed,
            "prompt_tokens": t.c.prompt_tokens + ex.prompt_tokens,
            "completion_tokens": t.c.completion_tokens + ex.completion_tokens,
            "gpu_seconds": t.c.gpu_seconds + ex.gpu_seconds,
        },
    )


def _upsert() -> Insert:
    # Built once, on the table (not the ORM class), with bound parameters: building this statement and
    # going through the ORM's bulk-insert path per finished job was a sixth of a worker's CPU.
    return _on_conflict(insert(_TABLE).values(day=_DAY, **{c: bindparam(c) for c in _COLUMNS}))


def billed_with(ending: Update) -> Select:
    """One statement that makes `ending` (a job's compare-and-set end, RETURNING at least tenant_id,
    key_id and model) and counts the job it ended in `usage_daily`, returning what `ending` returns:
    a data-modifying CTE, atomic on its own, so an autocommit connection ends and bills a job in one
    round trip instead of BEGIN, UPDATE, upsert and COMMIT. A lost compare-and-set returns no row and
    bills nothing. Parameters: `ending`'s, and `bill`'s."""
    ended = ending.cte("ended")
    c = _TABLE.c
    rows = select(
        _DAY,
        ended.c.tenant_id,
        func.coalesce(ended.c.key_id, 0),
        ended.c.model,
        ended.c.service_tier,
        literal(1, BigInteger),
        bindparam("failed", type_=c.failed.type),
        bindparam("prompt_tokens", type_=c.prompt_tokens.type),
        bindparam("completion_tokens", type_=c.completion_tokens.type),
        bindparam("gpu_seconds", type_=c.gpu_seconds.type),
    )
    billed = _on_conflict(insert(_TABLE).from_select(["day", *_COLUMNS], rows)).cte("billed")
    return select(*ended.c).add_cte(billed)


def bill(outcome: Ending, prompt_tokens: int, completion_tokens: int, gpu_seconds: float) -> dict[str, Any]:
    """`billed_with`'s usage parameters for one job."""
    return {
        "failed": 0 if outcome == Ending.succeeded else 1,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "gpu_seconds": gpu_seconds,
    }


UPSERT = _upsert()


def record(
    *,
    tenant_id: int,
    key_id: int | None,
    model: str,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    gpu_seconds: float = 0.0,
    outcome: Ending = Ending.succeeded,
    requests: int = 1,
    service_tier: str = "default",
) -> dict[str, Any]:
    """Count the job (or `requests` jobs that ended alike, their tokens summed) in the metrics;
    returns the parameters of `UPSERT` for its usage row."""
    REQUESTS.labels(str(tenant_id), model, outcome).inc(requests)
    TOKENS.labels(str(tenant_id), model, "prompt").inc(prompt_tokens)
    TOKENS.labels(str(tenant_id), model, "completion").inc(completion_tokens)
    SECONDS.labels(str(tenant_id), model).inc(gpu_seconds)
    TIERS.labels(model, service_tier).inc(requests)
    return {
        "tenant_id": tenant_id,
        "key_id": key_id or 0,
        "model": model,
        "service_tier": service_tier,
        "requests": requests,
        "failed": 0 if outcome == Ending.succeeded else requests,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "gpu_seconds": gpu_seconds,
    }


# -- Redis bytes: what each tenant's ended jobs hold there --------------------------------------------
# Counted as each job ends (core/infra/streams/write.py `_SEAL`: MEMORY USAGE of its stream, marks and fence, added
# to the tenant's field of that window's hash). What a job leaves lives `ended_events_ttl_s`, so the
# current window's count plus the previous one's covers everything still there: an upper bound, never
# under what is held, at most one window's worth of expired bytes over. A running job's stream is
# counted when it ends (admission bounds its size meanwhile); a job that never ran counts 0.


def _windows(ended_ttl_s: int) -> tuple[str, str]:
    w = write.stored_window(ended_ttl_s)
    return redis_keys.stored_bytes(w), redis_keys.stored_bytes(w - 1)


def redis_bytes(rds: Any, ended_ttl_s: int) -> dict[int, int]:
    """Every tenant's Redis bytes (sync client): tenant id -> bytes, tenants with none left out."""
    pipe = rds.pipeline(transaction=False)
    for key in _windows(ended_ttl_s):
        pipe.hgetall(key)
    out: dict[int, int] = {}
    for counts in pipe.execute():
        for tenant, n in counts.items():
            out[int(tenant)] = out.get(int(tenant), 0) + int(n)
    return out


async def tenant_redis_bytes(rds: Any, ended_ttl_s: int, tenant_id: int) -> int:
    """One tenant's Redis bytes (asyncio client)."""
    pipe = rds.pipeline(transaction=False)
    for key in _windows(ended_ttl_s):
        pipe.hget(key, str(tenant_id))
    return sum(int(n) for n in await pipe.execute() if n is not None)
