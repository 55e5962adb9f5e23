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
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
from sqlalchemy import Update, and_, delete, func, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from core import idempotency
from core.config import Settings
from core.errors import DomainError, ErrorKind, invalid, not_found
from core.files import expiry, storage
from core.idempotency import Idempotency
from core.infra import redis_keys, threads, transient
from core.infra.kv import Lua
from core.infra.orm import File, Tenant
from core.protocol import render
from core.states import FileStatus

log = logging.getLogger(__name__)

# What tenants upload counts against their quota; the files Spool writes (batch output) do not.
WRITTEN_BY_SPOOL = "batch_output"
UPLOADING = FileStatus.uploading.value
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

    def finish(self, purpose: str, record: Update | None = None, expires_s: int | None = None) -> File:
        """Make the stored file visible, kept `expires_s` after its creation (`expires_after`; by
        default 30 days). `record`: the statement that names it as its Idempotency-Key's object
        (idempotency.record_statement), run in the same transaction: when it matches nothing (a retry
        took the key over) nothing is kept and the upload is a 409."""
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
                    status=FileStatus.processed.value,
                    deleted=False,
                    expires_at=File.created_at + timedelta(seconds=expires_s or expiry.DEFAULT_S),
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


async def discard(upload: Upload) -> None:
    """Remove what an upload stored (and give its quota back), even while the request is cancelled."""
    with anyio.CancelScope(shield=True):
        await threads.run("upload", upload.abort)


async def keep(
    sessions: async_sessionmaker[AsyncSession],
    keys: Idempotency,
    upload: Upload,
    purpose: str,
    filename: str | None,
    key: str | None,
    expires_s: int | None = None,
) -> File:
    """A received upload, kept under the request's Idempotency-Key `key` (and `expires_s` after its
    creation: `finish`). The whole request counts: a retried upload (same key, purpose, name, expiry
    and content) gets the file the first one stored, and this copy is discarded; another file under
    the same key is a 422, whatever its size. Otherwise the upload is made visible and named by the key
    in one transaction, only while this request holds it."""
    payload = {"purpose": purpose, "filename": filename, "bytes": upload.bytes, "sha256": upload.sha256}
    if expires_s is not None:  # only when sent: a retry of a request made before this field hashes the same
        payload["expires_s"] = expires_s
    async with keys.held(upload.tenant_id, key, "/v1/files", payload) as claim:
        if claim is not None and claim.replay is not None:
            f = await find(sessions, claim.replay, upload.tenant_id)
            if f is not None:
                await discard(upload)  # the first request's file is the answer: this copy goes
                return f
        record = idempotency.record_statement(claim, upload.file_id)
        return await threads.run("upload", upload.finish, purpose, record, expires_s)


# -- reading: lists, lookups, deletion, downloads ----------------------------------------------------


def file_not_found(file_id: str) -> DomainError:
    return not_found(f"No such File object: {file_id}", param="id", code="file_not_found")


# Lists and lookups are synchronous, for a thread (api/bodies.json_response): rows decoded and rendered
# off the API's event loop.
def list_page(
    sessions: sessionmaker[Session], tenant_id: int, purpose: str | None, limit: int, after: str | None, order: str
) -> dict[str, Any]:
    """A page of the tenant's files as OpenAI's list object (`order`: "desc", newest first, or "asc")."""
    newest_first = order == "desc"
    with sessions() as s:
        stmt = select(File).where(File.tenant_id == tenant_id, File.deleted.is_(False))
        if purpose:
            stmt = stmt.where(File.purpose == purpose)
        if after:
            cursor = s.scalar(
                select(File.created_at).where(File.id == after, File.tenant_id == tenant_id, File.deleted.is_(False))
            )
            if cursor is not None:
                stmt = stmt.where(File.created_at < cursor if newest_first else File.created_at > cursor)
        stmt = stmt.order_by(File.created_at.desc() if newest_first else File.created_at).limit(limit + 1)
        rows = s.scalars(stmt).all()
    return render.page([render.file(f) for f in rows[:limit]], len(rows) > limit)


def retrieve(sessions: sessionmaker[Session], file_id: str, tenant_id: int) -> dict[str, Any]:
    """The tenant's file object (a 404 for anyone else's, or a deleted one)."""
    with sessions() as s:
        f = s.scalar(storage.get_for_tenant(file_id, tenant_id))
    if f is None:
        raise file_not_found(file_id)
    return render.file(f)


async def find(sessions: async_sessionmaker[AsyncSession], file_id: str, tenant_id: int) -> File | None:
    """The tenant's file (None for anyone else's, or a deleted one), read in a short session."""
    async with sessions() as s:
        return (await s.execute(storage.get_for_tenant(file_id, tenant_id))).scalar()


async def delete_file(sessions: async_sessionmaker[AsyncSession], file_id: str, tenant_id: int) -> None:
    """Mark the file deleted and remove its content; the row stays for batches that name it."""
    async with sessions() as s:
        f = (await s.execute(storage.get_for_tenant(file_id, tenant_id))).scalar()
        if f is None:
            raise file_not_found(file_id)
        f.deleted = True
        await s.execute(delete(storage.FileChunk).where(storage.FileChunk.file_id == file_id))
        await s.commit()


# A download holds a slot of its tenant's (a leased member of a Redis sorted set, shared by every API
# replica) from its first byte to its last, renewed while it lasts, so one tenant's slow or stalled
# readers are bounded; a slot of a process that died is free once its lease has passed.
DOWNLOAD_LEASE_S = 60.0
_TAKE_SLOT = Lua(
    r"""
-- KEYS: 1 the tenant's downloads (member: slot, score: lease end in ms). ARGV: 1 now_ms 2 most 3 slot 4 lease_ms
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[4]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""
)


def too_many_downloads(most: int) -> DomainError:
    return DomainError(
        ErrorKind.rate_limited,
        f"Too many downloads at once: this organization may have {most} in progress "
        "(SPOOL_DOWNLOAD_CONCURRENCY). Please try again in 1s.",
        type_="requests",
        code="rate_limit_exceeded",
        headers={"retry-after": "1"},
    )


@dataclass
class Download:
    """One file's content on its way to a client: `chunks()` reads each chunk in a short session of its
    own, so nothing of the database is held while bytes flow (a client that stops reading holds a
    socket and a slot, never a connection or a transaction). `hold()` keeps the slot while it lasts;
    `close()` gives it back."""

    file: File
    sessions: async_sessionmaker[AsyncSession]
    rds: Any
    key: str
    slot: str

    async def chunks(self) -> AsyncIterator[bytes]:
        seq = 0
        while True:
            # One statement, then the connection goes back to the pool. Shielded: a client that goes
            # away mid-read lets it finish (milliseconds) rather than costing the connection.
            with anyio.CancelScope(shield=True):
                async with self.sessions() as s:
                    data = await s.scalar(
                        select(storage.FileChunk.data).where(
                            storage.FileChunk.file_id == self.file.id, storage.FileChunk.seq == seq
                        )
                    )
            if data is None:
                return
            yield data
            seq += 1

    async def hold(self) -> None:
        """Renew the slot's lease until cancelled (also while the client reads nothing)."""
        lease_ms = int(DOWNLOAD_LEASE_S * 1000)
        while True:
            await anyio.sleep(DOWNLOAD_LEASE_S / 3)
            try:
                await self.rds.zadd(self.key, {self.slot: time.time() * 1000 + lease_ms}, xx=True)
                await self.rds.pexpire(self.key, lease_ms)
            except transient.REDIS as exc:  # Redis away a moment: the next renewal, or the lease's end
                log.warning("download slot of %s not renewed: %s", self.file.id, type(exc).__name__)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.rds.zrem(self.key, self.slot)
            except transient.REDIS as exc:  # the lease frees it
                log.warning("download slot of %s not given back: %s", self.file.id, type(exc).__name__)


async def open_download(
    sessions: async_sessionmaker[AsyncSession], rds: Any, file_id: str, tenant_id: int, most: int
) -> Download:
    """The tenant's file, ready to stream, holding one of its `most` download slots (0: no cap): a 404
    for a file it cannot see, OpenAI's 429 (with `retry-after`) when every slot is taken."""
    f = await find(sessions, file_id, tenant_id)
    if f is None:
        raise file_not_found(file_id)
    key, slot = redis_keys.tenant_limit(tenant_id, "downloads"), secrets.token_hex(8)
    if most > 0:
        lease_ms = int(DOWNLOAD_LEASE_S * 1000)
        if not int(await _TAKE_SLOT.run_async(rds, [key], int(time.time() * 1000), most, slot, lease_ms)):
            raise too_many_downloads(most)
    return Download(f, sessions, rds, key, slot)
