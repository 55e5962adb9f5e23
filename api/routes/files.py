"""OpenAI's Files API. Uploads are spooled to disk by the multipart parser, then copied into
Postgres in 1 MiB chunks from a worker thread: never whole in memory."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy import delete, select

from api.deps import SessionDep, SettingsDep, TenantDep
from api.errors import APIError
from core import idempotency
from core.files import storage as files
from core.files.service import store
from core.infra.db import async_sessions
from core.infra.orm import File
from core.protocol.render import page
from core.protocol.schemas import FileDeleted, FileList, FileObject

router = APIRouter(prefix="/v1/files")
PURPOSES = {"batch"}


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


@router.post("", response_model=FileObject)
async def upload(
    request: Request,
    tenant: TenantDep,
    session: SessionDep,
    settings: SettingsDep,
    file: UploadFile,
    purpose: str = Form(...),
) -> dict:
    if purpose not in PURPOSES:
        raise APIError(
            400,
            f"Invalid purpose '{purpose}': Spool accepts {sorted(PURPOSES)}.",
            param="purpose",
            code="invalid_value",
        )
    # A retried upload (same key, purpose, name and size) returns the file the first one stored.
    payload = {"purpose": purpose, "filename": file.filename, "bytes": file.size}
    claim = await idempotency.claim(tenant.id, request.headers.get("idempotency-key"), "/v1/files", payload)
    if claim is not None and claim.replay is not None:
        f = (await session.execute(files.get_for_tenant(claim.replay, tenant.id))).scalar()
        if f is not None:
            return files.file_json(f)
    try:
        stored = await anyio.to_thread.run_sync(store, file.file, file.filename, tenant.id, purpose, settings)
    except BaseException:
        await idempotency.release(claim)
        raise
    await idempotency.record(claim, stored.id)
    return files.file_json(stored)


@router.get("", response_model=FileList)
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


@router.get("/{file_id}", response_model=FileObject)
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


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    f = (await session.execute(files.get_for_tenant(file_id, tenant.id))).scalar()
    if f is None:
        raise _not_found(file_id)
    f.deleted = True  # the row stays for batches that name it; its content goes
    await session.execute(delete(files.FileChunk).where(files.FileChunk.file_id == file_id))
    await session.commit()
    return {"id": file_id, "object": "file", "deleted": True}
