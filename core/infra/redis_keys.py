"""The names of Spool's Redis keys: one place to see every namespace, what each key holds and who uses it.

A key's literal lives only in core/infra (tests/unit/test_homes.py checks it): here, or, for the
job's event stream and its cancel flag, fence and marks, in core/infra/streams/keys.py (the stream
hub's wake key in core/infra/streams/read.py). Celery's broker keys are kombu's own (core/infra/broker.py).
Namespaces: `job:` (one job), `rl:` (rate limits), `spool:` (the deployment), `ui:` (the status page).
"""

from __future__ import annotations


def readers(job_id: str) -> str:
    """A sorted set, one leased entry per SSE stream following the job now, on any API replica (api/sse.py)."""
    return f"job:{job_id}:readers"


def tenant_limit(tenant_id: int, name: str) -> str:
    """A tenant's rate-limit state (`rpm`, `tpm`, `tpd:<day>`, `active`, `reads`), kept by the Lua scripts of
    core/tenancy/limits.py; `downloads`: its download slots (core/files/service.py)."""
    return f"rl:t{tenant_id}:{name}"


def key_limit(key_id: int, name: str) -> str:
    """An API key's own rate-limit state (`rpm`, `tpm`), beside its tenant's."""
    return f"rl:k{key_id}:{name}"


def reservation(job_id: str) -> str:
    """The tokens a job reserved on admission, refunded once by the settlement when it ends."""
    return f"rl:res:{job_id}"


def revoked(digest: str) -> str:
    """Set when an API key is revoked, so API processes drop their cached lookup at once."""
    return f"spool:keys:revoked:{digest}"


def stored_bytes(window: int) -> str:
    """A hash, one field per tenant: the bytes its jobs' ended streams, marks and fences took in Redis, added
    as each job ended within this window (core/infra/streams/write.py `_SEAL`); read by core/tenancy/usage.py."""
    return f"spool:stored:redis:{window}"


def dispatcher_probe(name: str) -> str:
    """A dispatcher's write probe, rewritten every pass with a short TTL (core/dispatcher.py)."""
    return f"spool:dispatcher:probe:{name}"


def live_workers(model: str) -> str:
    """A hash of the worker heartbeats serving a model (core/jobs/live_workers.py)."""
    return f"spool:workers:{model}"


# A list pushed when a batch slot frees; the dispatcher blocks on it.
DISPATCHER_WAKE = "spool:dispatcher:wake"

# A list the API pushes a created batch's id onto, so a validator (core/batches/ingest.py) starts at
# once, not at its next poll.
BATCH_VALIDATE_WAKE = "spool:batches:validate"


def ui_session(token: str) -> str:
    """A status-page session: the digest of the admin key that opened it, never the key."""
    return f"ui:session:{token}"
