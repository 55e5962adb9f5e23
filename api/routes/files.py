"""OpenAI's Files API. Uploads are streamed into Postgres in 1 MiB chunks as they arrive, the
tenant's storage quota reserved per chunk (api/uploads.py): never whole in memory, never on local disk."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import delete, select

from api import uploads
from api.deps import IdempotencyDep, SessionDep, SettingsDep, SyncSessionsDep, TenantDep
from api.errors import APIError
from core import idempotency
from core.files import storage as files
from core.infra import threads
from core.infra.db import async_sessions
from core.infra.orm import File
from core.protocol import render
from core.protocol.schemas import FileDeleted, FileList, FileObject

router = APIRouter(prefix="/v1/files")
PURPOSES = {"batch"}


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


# The form is read by api/uploads.py, not declared as parameters: FastAPI would parse (and spool) the
# whole body before the handler could check anything. The schema still tells clients what to send.
_UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}},
                }
            }
        },
    }
}


def _check_purpose(fields: dict[str, str]) -> None:
    purpose = fields.get("purpose")
    if purpose is None:
        return  # not sent yet (or at all: checked again once the form has ended)
    if purpose not in PURPOSES:
        raise APIError(
            400,
            f"Invalid purpose '{purpose}': Spool accepts {sorted(PURPOSES)}.",
            param="purpose",
            code="invalid_value",
        )


@router.post("", response_model=FileObject, openapi_extra=_UPLOAD_FORM)
async def upload(
    request: Request,
    tenant: TenantDep,
    session: SessionDep,
    settings: SettingsDep,
    keys: IdempotencyDep,
    sessions: SyncSessionsDep,
) -> dict:
    got = await uploads.receive(request, sessions, tenant.id, settings, _check_purpose)
    up = got.upload
    try:
        purpose = got.fields.get("purpose")
        if purpose is None:
            raise APIError(
                400, "Missing required form field 'purpose'.", param="purpose", code="missing_required_parameter"
            )
        # The whole request: a retried upload (same key, purpose, name and content) returns the file
        # the first one stored; another file under the same key is a 422, whatever its size.
        payload = {"purpose": purpose, "filename": got.filename, "bytes": up.bytes, "sha256": up.sha256}
        async with keys.held(tenant.id, request.headers.get("idempotency-key"), "/v1/files", payload) as claim:
            if claim is not None and claim.replay is not None:
                f = (await session.execute(files.get_for_tenant(claim.replay, tenant.id))).scalar()
                if f is not None:
                    await uploads.abort(up)  # the first request's file is the answer: this copy goes
                    return render.file(f)
            # Stored and named by the key in one transaction, only while this request holds the key.
            stored = await threads.run("upload", up.finish, purpose, idempotency.record_statement(claim, up.file_id))
    except BaseException:
        await uploads.abort(up)
        raise
    return render.file(stored)


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
    data = [render.file(f) for f in rows[:limit]]
    return render.page(data, len(rows) > limit)


@router.get("/{file_id}", response_model=FileObject)
async def get_file(file_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    f = (await session.execute(files.get_for_tenant(file_id, tenant.id))).scalar()
    if f is None:
        raise _not_found(file_id)
    return render.file(f)


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
        headers={"content-length": str(f.bytes), "content-disposition": _disposition(f.filename)},
    )


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    f = (await session.execute(files.get_for_tenant(file_id, tenant.id))).scalar()
    if f is None:
        raise _not_found(file_id)
    f.deleted = True  # the row stays for batches that name it; its content goes
    await session.execute(delete(files.FileChunk).where(files.FileChunk.file_id == file_id))
    await session.commit()
    return render.file_deleted(file_id)


def _disposition(filename: str) -> str:
    """RFC 6266: an ASCII fallback name plus the exact name as RFC 5987 UTF-8 (headers are latin-1,
    so a name like '数据.jsonl' put raw made every download of it a 500)."""
    fallback = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"
