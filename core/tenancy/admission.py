"""Admission against the tenant's limits, and the 429 that refuses."""

from __future__ import annotations

import math

from core.errors import DomainError, ErrorKind
from core.infra.metrics import REFUSED
from core.tenancy import ratelimit
from core.tenancy.keys import Principal

_MESSAGES = {
    "requests": "Rate limit reached for requests per minute (RPM).",
    "tokens": "Rate limit reached for tokens per minute (TPM).",
    "tokens_per_day": "Daily token quota reached (tokens per day).",
    "queued_jobs": "Too many unfinished jobs for this tenant.",
}


def limits_of(p: Principal) -> ratelimit.Limits:
    t, k = p.tenant, p.key
    return ratelimit.Limits(
        rpm=t.rpm or 0,
        tpm=t.tpm or 0,
        tpd=t.tpd or 0,
        max_queued=t.max_queued or 0,
        key_rpm=k.rpm or 0,
        key_tpm=k.tpm or 0,
    )


async def admit(rds, principal: Principal, job_id: str, cost: int) -> dict[str, str]:
    """Take every limit for this job or raise OpenAI's 429. Returns the x-ratelimit-* headers."""
    d = await ratelimit.admit(rds, principal.tenant.id, principal.key.id, job_id, limits_of(principal), cost)
    if d.allowed:
        return d.headers
    REFUSED.labels(str(principal.tenant.id), d.refused).inc()
    headers = dict(d.headers)
    message = _MESSAGES[d.refused]
    if d.retry_after_s is None:
        message += f" This request needs {cost} tokens, more than the limit allows at all."
    else:
        headers["retry-after"] = str(max(1, math.ceil(d.retry_after_s)))
        message += f" Please try again in {d.retry_after_s:.3g}s."
    kind = "tokens" if d.refused.startswith("tokens") else "requests"
    raise DomainError(ErrorKind.rate_limited, message, type_=kind, code="rate_limit_exceeded", headers=headers)
