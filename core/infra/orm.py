"""The Postgres ledger: tenants, their API keys, and jobs. Alembic migrations mirror this file."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSON, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The ledger's words (core/states.py, the bottom layer), for the check constraints and defaults.
from core.states import BatchStatus, FileStatus, JobKind, JobState, KeyScope


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    # Share of the workers when tenants compete (weighted fair dispatch).
    weight: Mapped[int] = mapped_column(Integer, server_default="1")
    # Limits; NULL means unlimited.
    rpm: Mapped[int | None] = mapped_column(Integer)  # requests per minute
    tpm: Mapped[int | None] = mapped_column(Integer)  # tokens (prompt + max_tokens reserved) per minute
    tpd: Mapped[int | None] = mapped_column(BigInteger)  # tokens per day
    max_concurrent: Mapped[int | None] = mapped_column(Integer)  # jobs dispatched or running at once
    max_queued: Mapped[int | None] = mapped_column(Integer)  # jobs not yet finished
    max_storage_bytes: Mapped[int | None] = mapped_column(BigInteger)  # uploads kept; NULL: the deployment's
    # Bytes its jobs' and batches' rows may store (`tenant_stored`), and its ended jobs may hold in Redis
    # (core/tenancy/usage.py); NULL: the deployment's default, 0: no limit.
    max_stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_redis_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # May ask for `service_tier: "priority"` (served ahead of `default`); others asking get `default`.
    allow_priority: Mapped[bool] = mapped_column(Boolean, server_default="false")
    # Signs this tenant's webhooks (Standard Webhooks `whsec_...`); made on first use, rotatable.
    webhook_secret: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # sha256 of the whole key; the key itself is shown once, at creation, and never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(128))
    scope: Mapped[str] = mapped_column(String(16), server_default=KeyScope.user.value)
    revoked: Mapped[bool] = mapped_column(Boolean, server_default="false")
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rpm: Mapped[int | None] = mapped_column(Integer)  # optional per-key limits, on top of the tenant's
    tpm: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


_STATES_SQL = ", ".join(f"'{s.value}'" for s in JobState)
_KINDS_SQL = ", ".join(f"'{k.value}'" for k in JobKind)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(f"state IN ({_STATES_SQL})", name="ck_jobs_state"),
        # The dispatcher's scans: oldest queued first, stale dispatched, lapsed leases.
        Index("ix_jobs_state_created", "state", "created_at"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at"),
        # The fair dispatcher: each tenant's queued jobs of a model, best first.
        Index("ix_jobs_queue", "model", "state", "tenant_id", "kind", text("priority DESC"), "created_at"),
        # Queued API requests by tier: each tenant's heads of a lane, whether a lane is contended, and
        # the flex backlog, without walking a queued batch's lines (migration 0018).
        Index(
            "ix_jobs_queued_tier",
            "model",
            "service_tier",
            "tenant_id",
            text("priority DESC"),
            "created_at",
            postgresql_where=text("state = 'queued' AND kind = 'interactive'"),
        ),
        CheckConstraint(f"kind IN ({_KINDS_SQL})", name="ck_jobs_kind"),
        # A batch's lines: in input order, and each custom_id once.
        Index("ix_jobs_batch_line", "batch_id", "line_no", unique=True, postgresql_where=text("batch_id IS NOT NULL")),
        Index(
            "ix_jobs_batch_custom", "batch_id", "custom_id", unique=True, postgresql_where=text("batch_id IS NOT NULL")
        ),
        Index("ix_jobs_batch_state", "batch_id", "state", postgresql_where=text("batch_id IS NOT NULL")),
        # A tenant's stored chat completions (`store: true`, kept in `chat` under `stored`), in order
        # (core/jobs/chat_store.py, migration 0016).
        Index(
            "ix_jobs_chat_stored",
            "tenant_id",
            "created_at",
            "id",
            postgresql_where=text("(chat -> 'stored') IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[int | None] = mapped_column(BigInteger)  # the API key that created it (for usage)
    model: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16), server_default=JobKind.interactive.value)
    reserved_tokens: Mapped[int] = mapped_column(Integer, server_default="0")  # TPM/TPD reservation
    batch_id: Mapped[str | None] = mapped_column(String(40))  # a batch line: its batch,
    line_no: Mapped[int | None] = mapped_column(Integer)  # its line (1-based),
    custom_id: Mapped[str | None] = mapped_column(String(512))  # and the client's id for it
    state: Mapped[str] = mapped_column(String(16), server_default=JobState.queued.value)
    attempt: Mapped[int] = mapped_column(Integer, server_default="1")
    priority: Mapped[int] = mapped_column(Integer, server_default="0")
    # The tier that serves it (core/jobs/tiers.py): its lane in the fair dispatcher (migration 0018).
    service_tier: Mapped[str] = mapped_column(String(16), server_default="default")
    # Which worker's prefix cache should serve it (core/jobs/affinity.py; migration 0019). NULL: any.
    affinity: Mapped[int | None] = mapped_column(BigInteger)
    # Engine-neutral GenerationParams (core/generation/params.py) and the prompts, already normalized.
    params: Mapped[dict[str, Any]] = mapped_column(JSONB)
    prompts: Mapped[list[Any]] = mapped_column(JSONB)
    stream: Mapped[bool] = mapped_column(Boolean, server_default="false")
    # A chat completion: how to render it (tool-call parsing, chat logprobs) and, with `store: true`,
    # what it keeps for the stored-completion routes (`stored`). NULL: a text completion.
    chat: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # A response's chain (itself and every `previous_response_id` behind it): how many responses and
    # how many bytes of stored input items, written on insert by a trigger (migration 0013), so one
    # row tells whether a continuation may expand it. 0 on other jobs.
    chain_links: Mapped[int] = mapped_column(Integer, server_default="0")
    chain_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # What this row stores (request and result, as JSON text bytes), written by triggers on every
    # insert and on every write of its result, usage, error or chat (migration 0014), and added to its
    # tenant's `tenant_stored` by the same statement.
    stored_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    request_id: Mapped[str | None] = mapped_column(String(128))  # the x-request-id that created it
    user: Mapped[str | None] = mapped_column(String(256))
    # JSON, not JSONB: a result holds whatever text the model generated or echoed, a NUL character
    # included, which JSONB cannot store (its write failed after the client had read every token).
    # JSON keeps the text as written; nothing queries inside a result.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # Where each delta entry of the job's stream left its choice (core/infra/streams/write.py `marks_of`: a
    # compact string, ~12-16 bytes a delta), written by the ending: a resume from any event id is
    # placed in the row's text for as long as the row exists, not only while the ended stream lives.
    # NULL: the job streamed nothing (or ended before this column). Deferred: only a reader resuming
    # after the stream has expired needs it (`transitions.get_for_tenant` loads it).
    marks: Mapped[str | None] = mapped_column(JSONB(none_as_null=True), deferred=True)
    worker: Mapped[str | None] = mapped_column(String(256))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class UsageDaily(Base):
    """What a provider bills from: per day, tenant, key and model, written when jobs end."""

    __tablename__ = "usage_daily"

    day: Mapped[date] = mapped_column(Date, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # 0: no key
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    service_tier: Mapped[str] = mapped_column(String(16), primary_key=True, server_default="default")
    requests: Mapped[int] = mapped_column(BigInteger, server_default="0")
    failed: Mapped[int] = mapped_column(BigInteger, server_default="0")
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    gpu_seconds: Mapped[float] = mapped_column(Float, server_default="0")


class File(Base):
    """An uploaded or generated file (OpenAI's Files API). Content lives in `file_chunks`, in
    Postgres, so every API replica on every host sees the same files."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    lines: Mapped[int] = mapped_column(BigInteger, server_default="0")
    status: Mapped[str] = mapped_column(String(16), server_default=FileStatus.processed.value)
    deleted: Mapped[bool] = mapped_column(Boolean, server_default="false")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class FileChunk(Base):
    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    """OpenAI's batch object. Each input line becomes a job (kind 'batch') with batch_id/line_no."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[int | None] = mapped_column(BigInteger)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), server_default=BatchStatus.validating.value)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    request_counts: Mapped[dict[str, Any]] = mapped_column(
        JSONB, server_default='{"total": 0, "completed": 0, "failed": 0}'
    )
    # Kept by a trigger on jobs as lines end (migration 0010), never recounted: completed is lines
    # that succeeded, failed every other ending. request_counts keeps the total.
    lines_completed: Mapped[int] = mapped_column(BigInteger, server_default="0")
    lines_failed: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # While finalizing: the last line_no already written to the result files (NULL: not started).
    results_line: Mapped[int | None] = mapped_column(BigInteger)
    # The model its lines ask for (several: joined by ",", in the order each first appears), set by
    # validation; the usage its ended lines keep, summed by the same triggers as the counts (0017).
    model: Mapped[str | None] = mapped_column(Text)
    usage_prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    usage_cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    usage_completion_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # `output_expires_after.seconds`: its result files expire this long after they are created (NULL:
    # core/files/expiry.DEFAULT_S).
    output_expires_s: Mapped[int | None] = mapped_column(Integer)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB)
    webhook_url: Mapped[str | None] = mapped_column(String(2048))
    webhook_state: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    request_id: Mapped[str | None] = mapped_column(String(128))  # the x-request-id that created it
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # validation in progress
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    stored_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")  # as jobs' (migration 0014)


class TenantStored(Base):
    """Each tenant's stored bytes in `jobs` and `batches`, kept by those tables' triggers (migration
    0014) in a few slots per tenant (a backend adds to its own: no one hot row); the total is the sum.
    No foreign key: a tenant's cascade delete runs its jobs' delete trigger, which writes here."""

    __tablename__ = "tenant_stored"

    tenant_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    slot: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")


class IdempotencyKey(Base):
    """A client's `Idempotency-Key` on a creating POST, per tenant: the request it came with (as a
    hash) and the object it created, so a retry gets the original outcome instead of a second one."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (Index("ix_idempotency_created", "created_at"),)

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    request_hash: Mapped[str] = mapped_column(String(64))
    object_id: Mapped[str | None] = mapped_column(String(40))  # None while the first request is in flight
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    # While no object is recorded: which request holds the key (a random token), and until when (the
    # database's clock). The holder renews it while it works; past it, a retry takes the key over,
    # and the old holder's record, fenced by its token, no longer matches.
    lock_token: Mapped[str | None] = mapped_column(String(32))
    locked_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
