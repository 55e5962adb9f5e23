"""Admission against the tenant's limits, and the 429 that refuses."""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from core.errors import DomainError, ErrorKind
from core.infra.metrics import REFUSED
from core.tenancy import limits
from core.tenancy.keys import Principal

_MESSAGES = {
    "requests": "Rate limit reached for requests per minute (RPM).",
    "tokens": "Rate limit reached for tokens per minute (TPM).",
    "tokens_per_day": "Daily token quota reached (tokens per day).",
    "queued_jobs": "Too many unfinished jobs for this tenant.",
    "reads": "Rate limit reached for reads per minute (SPOOL_READS_PER_MINUTE).",
}

# The x-ratelimit-*-requests headers of a request whose requests-per-minute the API's gate already
# took before reading its body (api/request_gate.py): admission then takes only the other limits.
REQUEST_TAKEN: ContextVar[dict[str, str] | None] = ContextVar("spool_request_taken", default=None)


def limits_of(p: Principal) -> limits.Limits:
    t, k = p.tenant, p.key
    return limits.Limits(
        rpm=t.rpm or 0,
        tpm=t.tpm or 0,
        tpd=t.tpd or 0,
        max_queued=t.max_queued or 0,
        key_rpm=k.rpm or 0,
        key_tpm=k.tpm or 0,
    )


def refusal(tenant_id: int, d: limits.Decision, cost: int = 0) -> DomainError:
    """OpenAI's 429 for a refused decision, naming the limit."""
    REFUSED.labels(str(tenant_id), d.refused).inc()
    headers = dict(d.headers)
    message = _MESSAGES[d.refused]
    if d.retry_after_s is None:
        # A request without max_tokens reserves the rest of the context (a chat request runs to the
        # context's end, as OpenAI's does): name the way out.
        message += (
            f" This request needs {cost} tokens, more than the limit allows at all;"
            " set `max_tokens` (or `max_completion_tokens`) to reserve less."
        )
    else:
        headers["retry-after"] = str(max(1, math.ceil(d.retry_after_s)))
        message += f" Please try again in {d.retry_after_s:.3g}s."
    kind = "tokens" if d.refused.startswith("tokens") else "requests"
    return DomainError(ErrorKind.rate_limited, message, type_=kind, code="rate_limit_exceeded", headers=headers)


async def admit(rds, principal: Principal, job_id: str, cost: int) -> dict[str, str]:
    """Take every limit for this job or raise OpenAI's 429. Returns the x-ratelimit-* headers."""
    caps = limits_of(principal)
    taken = REQUEST_TAKEN.get()
    if taken is not None:
        caps = replace(caps, rpm=0, key_rpm=0)
    d = await limits.admit(rds, principal.tenant.id, principal.key.id, job_id, caps, cost)
    if d.allowed:
        return {**(taken or {}), **d.headers}
    raise refusal(principal.tenant.id, d, cost)


async def precheck(rds, principal: Principal, floor: int) -> None:
    """OpenAI's 429 now if a job of at least `floor` tokens could not be admitted (tokens per minute,
    per day, queued jobs), before the work of counting its prompt exactly; nothing is taken."""
    caps = limits_of(principal)
    if not (caps.tpm or caps.key_tpm or caps.tpd or caps.max_queued):
        return
    d = await limits.peek(rds, principal.tenant.id, principal.key.id, caps, floor)
    if not d.allowed:
        raise refusal(principal.tenant.id, d, floor)


async def take_request(rds, principal: Principal) -> dict[str, str]:
    """Requests per minute alone, before the body is read; the headers, or OpenAI's 429."""
    t, k = principal.tenant, principal.key
    if not (t.rpm or k.rpm):
        return {}
    d = await limits.take_request(rds, t.id, k.id, t.rpm or 0, k.rpm or 0)
    if d.allowed:
        return d.headers
    raise refusal(t.id, d)


async def take_read(rds, principal: Principal, per_minute: int) -> None:
    """One read from the tenant's reads per minute (every key of it together), or OpenAI's 429."""
    if per_minute <= 0:
        return
    d = await limits.take_read(rds, principal.tenant.id, per_minute)
    if not d.allowed:
        raise refusal(principal.tenant.id, d)


@dataclass(frozen=True)
class Line:
    """A batch line about to dispatch, with its tenant's limits."""

    job_id: str
    tenant_id: int
    key_id: int
    cost: int
    tpd: int
    max_queued: int


def admit_lines(rds: Any, lines: list[Line]) -> tuple[set[str], dict[str, str]]:
    """Batch lines count against their tenant's daily token quota and `max_queued` as they dispatch
    (not rpm/tpm: like OpenAI's, batch work has its own, enqueued-token limit, checked when the batch
    is validated). Returns (lines that must wait: the tenant has `max_queued` jobs live; lines over
    the daily quota, with the error message to fail them with). Lines of tenants with neither limit
    cost no round trip."""
    limited = [x for x in lines if x.tpd > 0 or x.max_queued > 0]
    if not limited:
        return set(), {}
    decisions = limits.admit_many(
        rds,
        [(x.tenant_id, x.key_id, x.job_id, limits.Limits(tpd=x.tpd, max_queued=x.max_queued), x.cost) for x in limited],
    )
    wait: set[str] = set()
    over: dict[str, str] = {}
    for x, d in zip(limited, decisions, strict=True):
        if d.allowed:
            continue
        REFUSED.labels(str(x.tenant_id), d.refused).inc()
        if d.refused == "tokens_per_day":
            over[x.job_id] = (
                f"{_MESSAGES['tokens_per_day']} This line needs {x.cost} tokens (prompt + max_tokens) and the "
                f"tenant's daily token quota is {x.tpd}; it was not run."
            )
        else:
            wait.add(x.job_id)
    return wait, over
