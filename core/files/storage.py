"""File content in Postgres: 1 MiB chunks, written and read one chunk at a time, so neither an
upload, a download, nor a million-line batch is ever held whole in memory. A download reads each
chunk in a short session of its own (core/files/service.Download), never one session for the whole
transfer: a client that stops reading must not hold a database connection."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from core.infra.orm import File, FileChunk

__all__ = [
    "CHUNK",
    "ChunkWriter",
    "File",
    "FileChunk",
    "insert_chunk",
    "iter_lines",
    "new_file_id",
]

CHUNK = 1 << 20


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def get_for_tenant(file_id: str, tenant_id: int):
    return select(File).where(File.id == file_id, File.tenant_id == tenant_id, File.deleted.is_(False))


class LineTooLong:
    """Stands for a line longer than the limit: its bytes were skipped, never held."""

    def __init__(self, size: int) -> None:
        self.size = size


def iter_lines(session: Session, file_id: str, max_line: int = 1 << 62) -> Iterator[bytes | LineTooLong]:
    """The file's lines (without newlines), reading one chunk at a time. A line longer than
    `max_line` bytes comes out as a LineTooLong, so a file without newlines is never held whole."""
    seq, rest, skipping = 0, b"", 0
    while True:
        data = session.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq))
        if data is None:
            break
        seq += 1
        if skipping:
            cut = data.find(b"\n")
            if cut < 0:
                skipping += len(data)
                continue
            yield LineTooLong(skipping + cut)
            data, skipping = data[cut + 1 :], 0
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line if len(line) <= max_line else LineTooLong(len(line))
        if len(rest) > max_line:
            skipping, rest = len(rest), b""
    if skipping:
        yield LineTooLong(skipping)
    elif rest:
        yield rest if len(rest) <= max_line else LineTooLong(len(rest))


class ChunkWriter:
    """Accumulates bytes and writes a chunk row every CHUNK bytes (sync session)."""

    def __init__(self, session: Session, file: File, seq: int = 0) -> None:
        self.session, self.file = session, file
        self.buf = bytearray()
        self.seq = seq  # where a file written over several transactions goes on (next_seq)

    def write(self, data: bytes) -> None:
        self.buf += data
        self.file.bytes += len(data)
        while len(self.buf) >= CHUNK:
            self._flush(bytes(self.buf[:CHUNK]))
            del self.buf[:CHUNK]

    def close(self) -> None:
        if self.buf:
            self._flush(bytes(self.buf))
            self.buf.clear()

    def _flush(self, data: bytes) -> None:
        self.session.execute(insert_chunk(self.file.id, self.seq, data))
        self.seq += 1


def next_seq(session: Session, file_id: str) -> int:
    """The seq of the chunk that would come after a file's last one."""
    last = session.scalar(select(func.max(FileChunk.seq)).where(FileChunk.file_id == file_id))
    return 0 if last is None else last + 1


def insert_chunk(file_id: str, seq: int, data: bytes):
    # A plain INSERT, not an ORM object: the session must not keep every chunk alive.
    return insert(FileChunk).values(file_id=file_id, seq=seq, data=data)
