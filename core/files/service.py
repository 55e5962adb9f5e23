"""Uploads: streamed into Postgres chunk by chunk as they arrive, the tenant's storage quota reserved
as the bytes come in.

An upload in progress is a `files` row with status `uploading`, hidden like a deleted file (every
read filters on `deleted`), whose `bytes` grow with each chunk. Each chunk is reserved under a
per-tenant transaction lock against everything the tenant keeps plus its uploads in progress, so
concurrent uploads cannot all pass through the same remaining room. A row left behind by a process
that died stops counting once its `expires_at` (pushed forward by every chunk) has passed, and is
removed by the tenant's next upload.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

from sqlalchemy import Update, and_, delete, func, or_, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from core import idempotency
from core.config import Settings
from core.errors import DomainError, ErrorKind, invalid
from core.files import storage
from core.infra.orm import File, Tenant

# What tenants upload counts against their quota; the files Spool writes (batch output) do not.
WRITTEN_BY_SPOOL = "batch_output"
UPLOADING = "uploading"
# An upload that received nothing for this long is dead (its process died mid-upload).
STALE = timedelta(minutes=10)
_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('spool:storage'), :t)")


def too_large(limit: int) -> DomainError:
    return DomainError(
        ErrorKind.too_large,
        f"File too large: the limit is {limit} bytes (SPOOL_MAX_FILE_BYTES).",
        param="file",
        code="file_too_large",
    )


class Upload:
    """One upload's life: `begin`, `write` each chunk (at most `storage.CHUNK` bytes; all but the last
    exactly that), then `finish` or `abort`. Synchronous: run it off the event loop. Each step is one
    short transaction on a session of `sessions`."""

    def __init__(self, sessions: sessionmaker[Session], tenant_id: int, settings: Settings) -> None:
        self.sessions, self.tenant_id, self.settings = sessions, tenant_id, settings
        self.file_id = storage.new_file_id()
        self.bytes = self.lines = self.seq = 0
        self.last = b""
        self._sha = hashlib.sha256()  # of the content, for the request's idempotency fingerprint

    def begin(self, filename: str | None) -> None:
        with self.sessions() as s:
            dead = s.scalars(
                select(File.id).where(
                    File.tenant_id == self.tenant_id, File.status == UPLOADING, File.expires_at < func.now()
                )
            ).all()
            if dead:
                s.execute(delete(File).where(File.id.in_(dead)))  # its chunks go with it (ON DELETE CASCADE)
            s.add(
                File(
                    id=self.file_id,
                    tenant_id=self.tenant_id,
                    purpose="batch",
                    filename=(filename or "upload.jsonl")[:512],
                    bytes=0,
                    lines=0,
                    status=UPLOADING,
                    deleted=True,
                    expires_at=datetime.now(UTC) + STALE,
                )
            )
            s.commit()

    def write(self, data: bytes) -> None:
        """Reserve `len(data)` bytes of the tenant's quota and store them as the next chunk, in one
        short transaction; a 413 naming the limit when either limit would be passed."""
        s_ = self.settings
        if self.bytes + len(data) > s_.max_file_bytes:
            raise too_large(s_.max_file_bytes)
        with self.sessions() as s:
            s.execute(_LOCK, {"t": self.tenant_id})  # until commit: one reservation of this tenant at a time
            quota = s.scalar(select(Tenant.max_storage_bytes).where(Tenant.id == self.tenant_id))
            quota = quota or s_.tenant_storage_bytes
            used = int(
                s.scalar(
                    select(func.coalesce(func.sum(File.bytes), 0)).where(
                        File.tenant_id == self.tenant_id,
                        File.purpose != WRITTEN_BY_SPOOL,
                        or_(
                            File.deleted.is_(False),
                            and_(File.status == UPLOADING, File.expires_at > func.now()),
                        ),
                    )
                )
                or 0
            )
            if used + len(data) > quota:
                raise DomainError(
                    ErrorKind.too_large,
                    f"Storage quota exceeded: this organization may keep {quota} bytes of files "
                    f"({max(quota - used, 0)} left, uploads in progress included). Delete files you no longer need.",
                    param="file",
                    code="storage_quota_exceeded",
                )
            self.bytes += len(data)
            self.lines += data.count(b"\n")
            if self.lines > s_.max_file_lines:
                raise invalid(
                    "file",
                    f"Too many lines: the limit is {s_.max_file_lines} (SPOOL_MAX_FILE_LINES).",
                    "too_many_lines",
                )
            s.execute(
                update(File)
                .where(File.id == self.file_id)
                .values(bytes=self.bytes, lines=self.lines, expires_at=func.now() + STALE)
            )
            s.execute(storage.insert_chunk(self.file_id, self.seq, data))
            s.commit()
        self.seq += 1
        self.last = data[-1:]
        self._sha.update(data)

    @property
    def sha256(self) -> str:
        """The hex SHA-256 of everything written so far."""
        return self._sha.hexdigest()

    def finish(self, purpose: str, record: Update | None = None) -> File:
        """Make the stored file visible (and kept for 30 days). `record`: the statement that names it
        as its Idempotency-Key's object (idempotency.record_statement), run in the same transaction:
        when it matches nothing (a retry took the key over) nothing is kept and the upload is a 409."""
        if self.bytes == 0:
            raise invalid("file", "The file is empty.", "empty_file")
        lines = self.lines + (self.last != b"\n")  # a last line without a newline
        with self.sessions() as s:
            f = s.scalar(
                update(File)
                .where(File.id == self.file_id, File.status == UPLOADING)
                .values(
                    purpose=purpose,
                    lines=lines,
                    status="processed",
                    deleted=False,
                    expires_at=datetime.now(UTC) + timedelta(days=30),
                )
                .returning(File)
            )
            if f is not None and record is not None and s.execute(record).first() is None:
                s.rollback()
                raise idempotency.in_progress()
            s.commit()
        if f is None:  # removed as dead meanwhile (it went silent for STALE): nothing kept
            raise invalid("file", "The upload took too long between two parts; please send it again.", "upload_expired")
        return f

    def abort(self) -> None:
        with self.sessions() as s:
            s.execute(delete(File).where(File.id == self.file_id, File.status == UPLOADING))
            s.commit()
