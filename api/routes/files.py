"""OpenAI's Files API. Uploads are streamed into Postgres in 1 MiB chunks as they arrive, the
tenant's storage quota reserved per chunk (api/uploads.py): never whole in memory, never on local disk."""

from __future__ import annotations

from urllib.parse import quote

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api import uploads
from api.costs import Body, OffLoop, cheap, sized, work
from api.deps import AsyncSessionsDep, IdempotencyDep, RedisDep, SettingsDep, SyncSessionsDep, TenantDep
from api.errors import APIError
from core.files import expiry, service
from core.protocol import render
from core.protocol.schemas import FileDeleted, FileList, FileObject

router = APIRouter(prefix="/v1/files")
PURPOSES = {"batch"}


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
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string"},
                        "expires_after[anchor]": {"type": "string", "enum": [expiry.ANCHOR]},
                        "expires_after[seconds]": {"type": "integer", "minimum": expiry.MIN_S, "maximum": expiry.MAX_S},
                    },
                }
            }
        },
    }
}


def _check_fields(fields: dict[str, str]) -> None:
    """The text fields sent so far (before the file, and again once the form has ended)."""
    expiry.form_seconds(fields, partial=True)
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
@work(body=Body.FILE)
async def upload(
    request: Request,
    tenant: TenantDep,
    settings: SettingsDep,
    keys: IdempotencyDep,
    sync_sessions: SyncSessionsDep,
    sessions: AsyncSessionsDep,
) -> dict:
    got = await uploads.receive(request, sync_sessions, tenant.id, settings, _check_fields)
    try:
        purpose = got.fields.get("purpose")
        if purpose is None:
            raise APIError(
                400, "Missing required form field 'purpose'.", param="purpose", code="missing_required_parameter"
            )
        expires_s = expiry.form_seconds(got.fields)
        key = request.headers.get("idempotency-key")
        stored = await service.keep(sessions, keys, got.upload, purpose, got.filename, key, expires_s)
    except BaseException:
        await service.discard(got.upload)
        raise
    return render.file(stored)


# Lists and lookups are read, rendered and encoded on the prepare threads (api/bodies.json_response).
@router.get("", response_model=FileList)
@sized
async def list_files(
    tenant: TenantDep,
    sessions: SyncSessionsDep,
    purpose: str | None = None,
    limit: int = 100,
    after: str | None = None,
    order: str = "desc",
) -> OffLoop:
    limit = max(1, min(limit, 10_000))
    return OffLoop(tenant.id, service.list_page, (sessions, tenant.id, purpose, limit, after, order))


@router.get("/{file_id}", response_model=FileObject)
@sized
async def get_file(file_id: str, tenant: TenantDep, sessions: SyncSessionsDep) -> OffLoop:
    return OffLoop(tenant.id, service.retrieve, (sessions, file_id, tenant.id))


class _Download(StreamingResponse):
    """A download's bytes, its slot held (and renewed) from the first byte to the last, given back
    however the response ends. No database session is held here: each chunk is read in one of its own."""

    def __init__(self, d: service.Download) -> None:
        headers = {"content-length": str(d.file.bytes), "content-disposition": _disposition(d.file.filename)}
        super().__init__(d.chunks(), media_type="application/jsonl", headers=headers)
        self.download = d

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.download.hold)
                await super().__call__(scope, receive, send)
                tg.cancel_scope.cancel()
        finally:
            await self.download.close()


@router.get(
    "/{file_id}/content",
    response_class=Response,  # no JSON body in the document (the bytes are declared below)
    responses={
        200: {
            "description": "The file's bytes (JSON Lines: a batch's input, output or errors)",
            "content": {"application/jsonl": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
@sized
async def file_content(
    file_id: str, tenant: TenantDep, redis: RedisDep, settings: SettingsDep, sessions: AsyncSessionsDep
) -> StreamingResponse:
    """The file's bytes; at most SPOOL_DOWNLOAD_CONCURRENCY of a tenant's at once (429 past it)."""
    most = settings.download_concurrency
    return _Download(await service.open_download(sessions, redis, file_id, tenant.id, most))


@router.delete("/{file_id}", response_model=FileDeleted)
@cheap
async def delete_file(file_id: str, tenant: TenantDep, sessions: AsyncSessionsDep) -> dict:
    await service.delete_file(sessions, file_id, tenant.id)
    return render.file_deleted(file_id)


def _disposition(filename: str) -> str:
    """RFC 6266: an ASCII fallback name plus the exact name as RFC 5987 UTF-8 (headers are latin-1,
    so a name like '数据.jsonl' put raw made every download of it a 500)."""
    fallback = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"
