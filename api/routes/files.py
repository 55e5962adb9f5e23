"""OpenAI's Files API. Uploads are spooled to disk by the multipart parser, then copied into
Postgres in 1 MiB chunks from a worker thread: never whole in memory."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import anyio
from fastapi import APIRouter, Form, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.deps import SessionDep, SettingsDep, TenantDep
from api.errors import APIError
from api.schemas import page
from core import files
from core.db import async_sessions, sync_sessions
from core.models import File
from core.settings import Settings

router = APIRouter(prefix="/v1/files")
PURPOSES = {"batch"}


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


def _store(upload: UploadFile, tenant_id: int, purpose: str, settings: Settings) -> dict:
    """Copy the spooled upload into Postgres, counting bytes and lines, within the limits."""
    with sync_sessions()() as session:
        f = File(
            id=files.new_file_id(),
            tenant_id=tenant_id,
            purpose=purpose,
            filename=(upload.filename or "upload.jsonl")[:512],
            bytes=0,
            lines=0,
            status="processed",
            expires_at=datetime.now(UTC) + timedelta(days=30),
        )
        session.add(f)
        session.flush()
        writer = files.ChunkWriter(session, f)
        last = b""
        while data := upload.file.read(files.CHUNK):
            writer.write(data)
            f.lines += data.count(b"\n")
            last = data[-1:]
            if f.bytes > settings.max_file_bytes:
                raise APIError(
                    413,
                    f"File too large: the limit is {settings.max_file_bytes} bytes.",
                    param="file",
                    code="file_too_large",
                )
            if f.lines > settings.max_file_lines:
                raise APIError(
                    400, f"Too many lines: the limit is {settings.max_file_lines}.", param="file", code="too_many_lines"
                )
        if f.bytes == 0:
            raise APIError(400, "The file is empty.", param="file", code="empty_file")
        if last != b"\n":
            f.lines += 1  # a last line without a newline
        writer.close()
        session.commit()
        return files.file_json(f)


@router.post("")
async def upload(tenant: TenantDep, settings: SettingsDep, file: UploadFile, purpose: str = Form(...)) -> dict:
    if purpose not in PURPOSES:
        raise APIError(
            400,
            f"Invalid purpose '{purpose}': Spool accepts {sorted(PURPOSES)}.",
            param="purpose",
            code="invalid_value",
        )
    return await anyio.to_thread.run_sync(_store, file, tenant.id, purpose, settings)


@router.get("")
async def list_files(
    tenant: TenantDep,
    session: SessionDep,
    purpose: str | None = None,
    limit: int = 100,
    after: str | None = None,
    order: str = "desc",
) -> dict:
    limit = max(1, min(limit, 10_000))
    stmt = select(File).where(File.tenant_id == tenant.id, File.deleted.is_(False))
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    if after:
        cursor = (await session.execute(files.get_for_tenant(after, tenant.id))).scalar()
        if cursor is not None:
            stmt = stmt.where(
                File.created_at < cursor.created_at if order == "desc" else File.created_at > cursor.created_at
            )
    stmt = stmt.order_by(File.created_at.desc() if order == "desc" else File.created_at).limit(limit + 1)
    rows = (await session.execute(stmt)).scalars().all()
    data = [files.file_json(f) for f in rows[:limit]]
    return page(data, len(rows) > limit)


@router.get("/{file_id}")
async def get_file(file_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    f = (await session.execute(files.get_for_tenant(file_id, tenant.id))).scalar()
    if f is None:
        raise _not_found(file_id)
    return files.file_json(f)


@router.get("/{file_id}/content")
async def file_content(file_id: str, tenant: TenantDep, session: SessionDep) -> StreamingResponse:
    f = (await session.execute(files.get_for_tenant(file_id, tenant.id))).scalar()
    if f is None:
        raise _not_found(file_id)

    async def stream():
        async with async_sessions()() as s:
            async for chunk in files.read_chunks(s, file_id):
                yield chunk

    return StreamingResponse(
        stream(),
        media_type="application/jsonl",
        headers={"content-length": str(f.bytes), "content-disposition": f'attachment; filename="{f.filename}"'},
    )


@router.delete("/{file_id}")
async def delete_file(file_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    f = (await session.execute(files.get_for_tenant(file_id, tenant.id))).scalar()
    if f is None:
        raise _not_found(file_id)
    f.deleted = True  # the row stays for batches that name it; its content goes
    await session.execute(files.FileChunk.__table__.delete().where(files.FileChunk.file_id == file_id))
    await session.commit()
    return {"id": file_id, "object": "file", "deleted": True}
