"""Building blocks for tests and benches: rows and values with sensible defaults, overridable per use.

Rows are written through the ORM on a given sync session; nothing here starts a process.
"""

from __future__ import annotations

import itertools
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from core.files import storage
from core.generation.params import GenerationParams
from core.infra.orm import ApiKey, Batch, File, Job, Tenant
from core.jobs import transitions
from core.states import BatchStatus, JobState
from core.tenancy.keys import hash_key, new_key

_n = itertools.count(1)


def params(**kw: Any) -> GenerationParams:
    return GenerationParams(**{"max_tokens": 4, "temperature": 0.0, **kw})


def tenant(session: Session, name: str | None = None, **limits: Any) -> Tenant:
    t = Tenant(name=name or f"tenant-{next(_n)}", **limits)
    session.add(t)
    session.commit()
    return t


def api_key(session: Session, t: Tenant, scope: str = "user") -> tuple[str, ApiKey]:
    plain = new_key()
    k = ApiKey(tenant_id=t.id, key_hash=hash_key(plain), prefix=plain[:16], scope=scope)
    session.add(k)
    session.commit()
    return plain, k


def job(
    session: Session,
    t: Tenant,
    *,
    state: JobState = JobState.queued,
    attempt: int = 1,
    lease_s: float | None = None,
    **kw: Any,
) -> Job:
    """A job row in `state`; a running one holds a lease `lease_s` from now (negative: lapsed)."""
    j = transitions.new_job(
        tenant_id=t.id,
        model=kw.pop("model", "smollm2-135m-instruct"),
        params=kw.pop("params", params()).to_json(),
        prompts=kw.pop("prompts", [{"ids": [1, 2, 3], "text": None}]),
        stream=False,
        **kw,
    )
    j.state, j.attempt = state.value, attempt
    if state == JobState.running:
        j.started_at = datetime.now(UTC)
        j.lease_until = datetime.now(UTC) + timedelta(seconds=lease_s if lease_s is not None else 60)
    session.add(j)
    session.commit()
    return j


def batch(
    session: Session,
    t: Tenant,
    *,
    status: BatchStatus = BatchStatus.in_progress,
    lines: int = 0,
    window_left_s: float = 3600,
    **kw: Any,
) -> Batch:
    """A batch row of `t` in `status`, its window ending `window_left_s` from now (negative: ended),
    with `lines` queued lines (custom ids r0, r1, ...; `key_id` passed on to them)."""
    now = datetime.now(UTC)
    b = Batch(
        id="batch_" + next(_batch_ids),
        tenant_id=t.id,
        endpoint="/v1/completions",
        input_file_id="file-x",
        completion_window="24h",
        status=status.value,
        created_at=now - timedelta(seconds=5),
        in_progress_at=now - timedelta(seconds=5),
        expires_at=now + timedelta(seconds=window_left_s),
        cancelling_at=now if status == BatchStatus.cancelling else None,
        request_counts={"total": lines, "completed": 0, "failed": 0},
        **kw,
    )
    session.add(b)
    session.commit()
    for i in range(lines):
        job(session, t, kind="batch", key_id=kw.get("key_id"), batch_id=b.id, line_no=i + 1, custom_id=f"r{i}")
    return b


def validating_batch(
    session: Session,
    t: Tenant,
    key: ApiKey,
    lines: list[dict[str, Any]],
    *,
    chunk_bytes: int | None = None,
    age_s: float = 0.0,
    lease_s: float | None = None,
) -> str:
    """The id of a batch of `t` awaiting validation of `lines`: its input file stored in chunks of
    `chunk_bytes` as an upload stores them (None: one chunk), created `age_s` ago; `lease_s`: held by a
    validator that long from now."""
    data = "\n".join(json.dumps(line) for line in lines).encode() + b"\n"
    fid, bid = storage.new_file_id(), f"batch_{uuid.uuid4().hex}"
    session.add(File(id=fid, tenant_id=t.id, purpose="batch", filename="in.jsonl", bytes=len(data), lines=len(lines)))
    session.flush()
    step = chunk_bytes or len(data)
    for seq, at in enumerate(range(0, len(data), step)):
        session.execute(storage.insert_chunk(fid, seq, data[at : at + step]))
    now = datetime.now(UTC)
    session.add(
        Batch(
            id=bid,
            tenant_id=t.id,
            key_id=key.id,
            endpoint="/v1/completions",
            input_file_id=fid,
            completion_window="24h",
            status=BatchStatus.validating.value,
            request_counts={"total": 0, "completed": 0, "failed": 0},
            created_at=now - timedelta(seconds=age_s),
            expires_at=now + timedelta(hours=24),
            lease_until=now + timedelta(seconds=lease_s) if lease_s is not None else None,
        )
    )
    session.commit()
    return bid


def remove_tenants(sessions: sessionmaker[Session], ids: list[int]) -> None:
    """Tenants a test made, with their jobs and batches (their keys and files go with them)."""
    with sessions() as s:
        s.execute(delete(Job).where(Job.tenant_id.in_(ids)))
        s.execute(delete(Batch).where(Batch.tenant_id.in_(ids)))
        s.execute(delete(Tenant).where(Tenant.id.in_(ids)))
        s.commit()


_batch_ids = (f"{n:024x}" for n in itertools.count(int(datetime.now(UTC).timestamp() * 1e6)))
