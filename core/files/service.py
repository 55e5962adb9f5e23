"""Uploads: a spooled upload copied into Postgres chunk by chunk, within the size and line limits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import BinaryIO

from sqlalchemy import func, select

from core.config import Settings
from core.errors import DomainError, ErrorKind, invalid
from core.files import storage
from core.infra.db import sync_sessions
from core.infra.orm import File, Tenant

# What tenants upload counts against their quota; the files Spool writes (batch output) do not.
WRITTEN_BY_SPOOL = "batch_output"


def store(upload: BinaryIO, filename: str | None, tenant_id: int, purpose: str, settings: Settings) -> File:
    """Copy the spooled upload into Postgres, counting bytes and lines, within the limits."""
    with sync_sessions()() as session:
        tenant = session.get(Tenant, tenant_id)
        quota = (tenant.max_storage_bytes if tenant else None) or settings.tenant_storage_bytes
        kept = session.scalar(
            select(func.coalesce(func.sum(File.bytes), 0)).where(
                File.tenant_id == tenant_id, File.deleted.is_(False), File.purpose != WRITTEN_BY_SPOOL
            )
        )
        room = quota - int(kept or 0)
        f = File(
            id=storage.new_file_id(),
            tenant_id=tenant_id,
            purpose=purpose,
            filename=(filename or "upload.jsonl")[:512],
            bytes=0,
            lines=0,
            status="processed",
            expires_at=datetime.now(UTC) + timedelta(days=30),
        )
        session.add(f)
        session.flush()
        writer = storage.ChunkWriter(session, f)
        last = b""
        while data := upload.read(storage.CHUNK):
            writer.write(data)
            f.lines += data.count(b"\n")
            last = data[-1:]
            if f.bytes > settings.max_file_bytes:
                raise DomainError(
                    ErrorKind.too_large,
                    f"File too large: the limit is {settings.max_file_bytes} bytes.",
                    param="file",
                    code="file_too_large",
                )
            if f.bytes > room:
                raise DomainError(
                    ErrorKind.too_large,
                    f"Storage quota exceeded: this organization may keep {quota} bytes of files "
                    f"({max(room, 0)} left). Delete files you no longer need.",
                    param="file",
                    code="storage_quota_exceeded",
                )
            if f.lines > settings.max_file_lines:
                raise invalid("file", f"Too many lines: the limit is {settings.max_file_lines}.", "too_many_lines")
        if f.bytes == 0:
            raise invalid("file", "The file is empty.", "empty_file")
        if last != b"\n":
            f.lines += 1  # a last line without a newline
        writer.close()
        session.commit()
        return f
