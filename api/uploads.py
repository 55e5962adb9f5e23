"""Reading a /v1/files upload as it arrives: multipart/form-data only, one file part streamed into
storage a chunk at a time (core/files/service.Upload reserves the tenant's quota per chunk), a few
small text fields, and nothing spooled to local disk or held whole in memory.

Starlette's `request.form()` would first spool the whole file to a temporary file (and keep up to
1000 fields of 1 MiB each) before any limit but the body size could be checked.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import ClientDisconnect, Request

from api.errors import APIError
from core.config import Settings
from core.files import storage
from core.files.service import Upload, discard
from core.infra import threads

MAX_PART_HEADERS = 8


def _bad(message: str, code: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class _Part:
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


@dataclass
class Received:
    upload: Upload
    filename: str | None
    fields: dict[str, str]


class _Form:
    """Callbacks of python-multipart's streaming parser; the file's bytes are collected into
    `pending`, which the caller drains (into storage) after each piece of the body."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.part = _Part()
        self.header_name = self.header_value = b""
        self.fields: dict[str, str] = {}
        self.files = 0
        self.filename: str | None = None
        self.pending = bytearray()
        self.in_file = False

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers.append((self.header_name.lower(), self.header_value))
        self.header_name = self.header_value = b""

    def on_headers_finished(self) -> None:
        disposition = next((v for k, v in self.part.headers if k == b"content-disposition"), b"")
        _, options = parse_options_header(disposition)
        if b"name" not in options:
            raise _bad('Each form part needs a Content-Disposition header with a "name".', "invalid_form")
        self.part.name = options[b"name"].decode("utf-8", "replace")
        if b"filename" in options:
            self.files += 1
            if self.files > 1 or self.part.name != "file":
                raise _bad("The form must carry exactly one file, in the field 'file'.", "too_many_files", "file")
            self.filename = options[b"filename"].decode("utf-8", "replace")
            self.in_file = True
        elif len(self.fields) >= self.settings.upload_max_fields:
            limit = self.settings.upload_max_fields
            raise _bad(f"Too many form fields: at most {limit} (SPOOL_UPLOAD_MAX_FIELDS).", "too_many_fields")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.in_file:
            self.pending += data[start:end]
            return
        self.part.data += data[start:end]
        limit = self.settings.upload_max_field_bytes
        if len(self.part.data) > limit:
            raise _bad(
                f"Form field '{self.part.name}' is too long: at most {limit} bytes (SPOOL_UPLOAD_MAX_FIELD_BYTES).",
                "field_too_long",
                self.part.name,
            )

    def on_part_end(self) -> None:
        if self.in_file:
            self.in_file = False
            return
        try:
            self.fields[self.part.name] = self.part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(f"Form field '{self.part.name}' is not UTF-8.", "invalid_form", self.part.name) from None


# A chunk is stored under its tenant's storage lock (`Upload.write`, core/files/service.py): while one of a
# tenant's chunks is being stored, its others would wait for that lock on upload threads, and a tenant
# with as many uploads as threads held every one of them. Here they wait on the event loop instead, for
# a lock of their tenant's: in each API process at most one upload thread waits for a tenant's storage
# lock, whatever it sends (per loop: tests run several).
_TENANT_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakValueDictionary[int, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _tenant_lock(tenant_id: int) -> asyncio.Lock:
    locks = _TENANT_LOCKS.setdefault(asyncio.get_running_loop(), weakref.WeakValueDictionary())
    lock = locks.get(tenant_id)
    if lock is None:
        lock = locks[tenant_id] = asyncio.Lock()
    return lock


async def _store(upload: Upload, chunk: bytes) -> None:
    """`upload.write(chunk)` on an upload thread, taken only once no other chunk of the tenant's is
    being stored by this process."""
    async with _tenant_lock(upload.tenant_id):
        await threads.run("upload", upload.write, chunk)


async def receive(
    request: Request, sessions: sessionmaker[Session], tenant_id: int, settings: Settings, check_fields=None
) -> Received:
    """Stream the request's form into a new upload (begun, not finished: the caller finishes or
    aborts it). `check_fields(fields)` runs as soon as the text fields before the file are known,
    so a bad `purpose` is refused before the file is read."""
    ctype, params = parse_options_header(request.headers.get("content-type"))
    if ctype != b"multipart/form-data" or not params.get(b"boundary"):
        raise _bad("Uploads must be sent as multipart/form-data (with a boundary).", "unsupported_content_type")
    form = _Form(settings)
    callbacks = {
        name: getattr(form, name)
        for name in (
            "on_part_begin",
            "on_part_data",
            "on_part_end",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
        )
    }
    parser = MultipartParser(params[b"boundary"], callbacks, max_header_count=MAX_PART_HEADERS)  # type: ignore[arg-type]
    upload = Upload(sessions, tenant_id, settings)
    begun = checked = False
    try:
        async for piece in request.stream():
            try:
                parser.write(piece)
            except MultipartParseError as exc:
                raise _bad(f"The multipart body is malformed: {exc}", "invalid_form") from None
            if form.in_file or form.pending:
                if not checked and check_fields is not None:
                    check_fields(form.fields)
                checked = True
                if not begun:
                    await threads.run("upload", upload.begin, form.filename)
                    begun = True
            while len(form.pending) >= storage.CHUNK:
                chunk = bytes(form.pending[: storage.CHUNK])
                del form.pending[: storage.CHUNK]
                await _store(upload, chunk)
        parser.finalize()
        if not begun:
            raise _bad("The form has no file: send it in the field 'file'.", "missing_file", "file")
        if form.pending:
            await _store(upload, bytes(form.pending))
            form.pending.clear()
        if check_fields is not None:
            check_fields(form.fields)
    except ClientDisconnect:
        if begun:
            await discard(upload)
        raise _bad("The upload ended before the whole body arrived.", "incomplete_upload") from None
    except BaseException:
        if begun:
            await discard(upload)
        raise
    return Received(upload, form.filename, form.fields)
