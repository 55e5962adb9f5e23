"""Usage accounting: one upsert per finished job into `usage_daily`, plus Prometheus counters.

Called in the same transaction as the job's terminal transition, by whoever makes it (worker,
API cancel, dispatcher reaper), so billing and job state cannot disagree.
"""

from __future__ import annotations

from sqlalchemy import Insert, func
from sqlalchemy.dialects.postgresql import insert

from core.infra.metrics import REQUESTS, SECONDS, TOKENS
from core.infra.orm import UsageDaily


def record(
    *,
    tenant_id: int,
    key_id: int | None,
    model: str,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    gpu_seconds: float = 0.0,
    outcome: str = "succeeded",
) -> Insert:
    failed = 0 if outcome == "succeeded" else 1
    REQUESTS.labels(str(tenant_id), model, outcome).inc()
    TOKENS.labels(str(tenant_id), model, "prompt").inc(prompt_tokens)
    TOKENS.labels(str(tenant_id), model, "completion").inc(completion_tokens)
    SECONDS.labels(str(tenant_id), model).inc(gpu_seconds)
    stmt = insert(UsageDaily).values(
        day=func.date(func.timezone("utc", func.now())),
        tenant_id=tenant_id,
        key_id=key_id or 0,
        model=model,
        requests=1,
        failed=failed,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        gpu_seconds=gpu_seconds,
    )
    ex = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[UsageDaily.day, UsageDaily.tenant_id, UsageDaily.key_id, UsageDaily.model],
        set_={
            "requests": UsageDaily.requests + ex.requests,
            "failed": UsageDaily.failed + ex.failed,
            "prompt_tokens": UsageDaily.prompt_tokens + ex.prompt_tokens,
            "completion_tokens": UsageDaily.completion_tokens + ex.completion_tokens,
            "gpu_seconds": UsageDaily.gpu_seconds + ex.gpu_seconds,
        },
    )
