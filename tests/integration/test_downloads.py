"""Downloads and uploads never hold what every tenant shares (issue 35): a download holds no database
session while its bytes flow (30 clients that stop reading pinned the whole pool: every tenant's next
request waited 10 s for a 503), a tenant has at most SPOOL_DOWNLOAD_CONCURRENCY downloads at once,
Postgres ends a transaction left idle, and one tenant's uploads waiting for its storage lock do not
hold the shared upload threads.

The API runs in-process (api/app.create_app under uvicorn, on a thread of its own, on 127.0.0.1) over
this session's integration database and Redis db; clients that stop reading are real sockets."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.files import storage
from core.infra import redis_keys
from core.infra.orm import File
from ops import factories
from tests.conftest import wait_for
from tests.integration.conftest import IT_DB, IT_REDIS, served_api

DOWNLOADS = 4  # SPOOL_DOWNLOAD_CONCURRENCY of the server below
UPLOAD_THREADS = 2
IDLE_TRANSACTION_S = 30
CHUNK = (b"x" * 1023 + b"\n") * 1024  # 1 MiB, 1024 lines


@dataclass
class Server:
    base: str
    port: int
    loop_thread: int  # the event loop's thread


@pytest.fixture(scope="module")
def api_server(sessions: sessionmaker[Session]) -> Iterator[Server]:
    env = {
        "SPOOL_DATABASE_URL": IT_DB,
        "SPOOL_REDIS_URL": IT_REDIS,
        "SPOOL_DOWNLOAD_CONCURRENCY": str(DOWNLOADS),
        "SPOOL_UPLOAD_THREADS": str(UPLOAD_THREADS),
        "SPOOL_DB_IDLE_TRANSACTION_S": str(IDLE_TRANSACTION_S),
        "SPOOL_LOG_FORMAT": "text",
    }
    with served_api(env) as served:
        yield Server(served.base, served.port, served.loop_thread)


def tenant_key(sessions: sessionmaker[Session]) -> tuple[int, str]:
    with sessions() as s:
        t = factories.tenant(s)
        key, _ = factories.api_key(s, t)
        return t.id, key


def stored_file(sessions: sessionmaker[Session], tenant_id: int, chunks: int) -> str:
    """A processed file of `chunks` MiB, written as an upload leaves it."""
    fid = storage.new_file_id()
    with sessions() as s:
        s.add(
            File(
                id=fid,
                tenant_id=tenant_id,
                purpose="batch",
                filename="big.jsonl",
                bytes=len(CHUNK) * chunks,
                lines=1024 * chunks,
                status="processed",
                deleted=False,
                expires_at=datetime.now(UTC) + timedelta(days=1),
            )
        )
        s.flush()
        for seq in range(chunks):
            s.execute(storage.insert_chunk(fid, seq, CHUNK))
        s.commit()
    return fid


def stalled_download(server: Server, key: str, file_id: str) -> socket.socket:
    """A client that asks for the file, reads the status line and then nothing more."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(
        f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: spool\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    )
    s.settimeout(30)
    head = s.recv(32)
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


def _pool_checked_out() -> int:
    from core.infra import db

    return db.async_engine().pool.checkedout()  # type: ignore[attr-defined]


def test_stalled_downloads_hold_no_database_session(api_server: Server, sessions: sessionmaker[Session]):
    # 8 tenants x 4 stalled downloads of 6 MiB: more than the socket buffers take, so each download
    # waits for a client that never reads. The old route held 2 sessions each: 64 of the pool's 60.
    owners = [tenant_key(sessions) for _ in range(8)]
    files = [stored_file(sessions, tid, 6) for tid, _ in owners]
    stalled = [
        stalled_download(api_server, key, fid)
        for (_, key), fid in zip(owners, files, strict=True)
        for _ in range(DOWNLOADS)
    ]
    try:
        assert len(stalled) == 32
        wait_for(lambda: _pool_checked_out() == 0, 10, "no connection checked out while 32 downloads stall")
        _, key = owners[0]
        auth = {"authorization": f"Bearer {key}"}
        started = time.monotonic()
        got = httpx.get(f"{api_server.base}/v1/files/{files[0]}", headers=auth, timeout=5)
        took = time.monotonic() - started
        assert got.status_code == 200 and got.json()["id"] == files[0]
        print(f"a request during 32 stalled downloads answered in {took * 1000:.0f} ms")
        # and another tenant's download, start to end, meanwhile
        other_tid, other_key = tenant_key(sessions)
        fid = stored_file(sessions, other_tid, 3)
        body = httpx.get(
            f"{api_server.base}/v1/files/{fid}/content", headers={"authorization": f"Bearer {other_key}"}, timeout=30
        )
        assert body.status_code == 200 and body.content == CHUNK * 3
    finally:
        for s in stalled:
            s.close()


def test_a_tenants_fifth_download_is_a_429_while_another_tenants_goes_on(
    api_server: Server, sessions: sessionmaker[Session], rds
):
    (a, key_a), (b, key_b) = tenant_key(sessions), tenant_key(sessions)
    file_a, file_b = stored_file(sessions, a, 6), stored_file(sessions, b, 2)
    slots = redis_keys.tenant_limit(a, "downloads")
    stalled = [stalled_download(api_server, key_a, file_a) for _ in range(DOWNLOADS)]
    try:
        assert rds.zcard(slots) == DOWNLOADS
        fifth = httpx.get(
            f"{api_server.base}/v1/files/{file_a}/content", headers={"authorization": f"Bearer {key_a}"}, timeout=10
        )
        assert fifth.status_code == 429, fifth.text
        assert fifth.headers["retry-after"] == "1"
        err = fifth.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert f"may have {DOWNLOADS} in progress" in err["message"] and "SPOOL_DOWNLOAD_CONCURRENCY" in err["message"]
        theirs = httpx.get(
            f"{api_server.base}/v1/files/{file_b}/content", headers={"authorization": f"Bearer {key_b}"}, timeout=30
        )
        assert theirs.status_code == 200 and theirs.content == CHUNK * 2
        wait_for(lambda: rds.zcard(redis_keys.tenant_limit(b, "downloads")) == 0, 10, "B's slot given back at its end")
    finally:
        for s in stalled:
            s.close()
    # the clients gone, their slots are given back: the tenant downloads again
    wait_for(lambda: rds.zcard(slots) == 0, 10, "the closed downloads' slots given back")
    again = httpx.get(
        f"{api_server.base}/v1/files/{file_a}/content", headers={"authorization": f"Bearer {key_a}"}, timeout=30
    )
    assert again.status_code == 200 and again.content == CHUNK * 6


def test_spools_connections_end_a_transaction_left_idle(api_server: Server):
    from sqlalchemy.ext.asyncio import create_async_engine

    from core.config import get_settings
    from core.infra import db

    # the engines the server runs on (the sync one: uploads, the lifecycle) ...
    with db.sync_engine().connect() as conn:
        assert conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar() == f"{IDLE_TRANSACTION_S}s"

    # ... and an API connection, as async_engine makes them (its own engine: the server's belongs to its loop)
    async def api_side() -> tuple[str, str]:
        engine = create_async_engine(IT_DB, connect_args=db.connect_args(get_settings(), api=True))
        try:
            async with engine.connect() as conn:
                idle = (await conn.execute(text("SHOW idle_in_transaction_session_timeout"))).scalar()
                statement = (await conn.execute(text("SHOW statement_timeout"))).scalar()
        finally:
            await engine.dispose()
        return idle, statement

    assert asyncio.run(api_side()) == (f"{IDLE_TRANSACTION_S}s", "1min")


def test_a_transaction_left_idle_past_the_setting_is_ended():
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError

    from core.config import Settings
    from core.infra import db

    engine = create_engine(IT_DB, connect_args=db.connect_args(Settings(db_idle_transaction_s=1)))
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))  # a transaction begun, then left idle
            time.sleep(2.5)  # time passing is the point: longer than the 1 s allowed
            with pytest.raises(DBAPIError, match="idle-in-transaction timeout"):
                conn.execute(text("SELECT 1"))
    finally:
        engine.dispose()


def _form(content: bytes) -> dict:
    return {"files": {"file": ("in.jsonl", content, "application/jsonl")}, "data": {"purpose": "batch"}}


def test_a_tenants_uploads_waiting_for_its_lock_leave_the_upload_threads_to_others(
    api_server: Server, sessions: sessionmaker[Session]
):
    (a, key_a), (_, key_b) = tenant_key(sessions), tenant_key(sessions)
    line = b'{"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {}}\n'

    async def run() -> tuple[list[httpx.Response], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=api_server.base, timeout=60) as client:
            # Tenant A's storage lock, held here: each of its chunks waits for it.
            with sessions() as s:
                s.execute(text("SELECT pg_advisory_xact_lock(hashtext('spool:storage'), :t)"), {"t": a})
                waiting = [
                    asyncio.create_task(
                        client.post("/v1/files", headers={"authorization": f"Bearer {key_a}"}, **_form(CHUNK * 2))
                    )
                    for _ in range(UPLOAD_THREADS + 2)
                ]
                await asyncio.sleep(1.0)  # time passing is the point: A's uploads reach the lock and wait
                assert not any(t.done() for t in waiting)
                started = time.monotonic()
                other = await asyncio.wait_for(
                    client.post("/v1/files", headers={"authorization": f"Bearer {key_b}"}, **_form(line)), 20
                )
                took = time.monotonic() - started
                assert not any(t.done() for t in waiting)
                s.rollback()  # A's lock given back: its uploads go on
            return list(await asyncio.gather(*waiting)), other, took

    theirs, other, took = asyncio.run(run())
    print(f"another tenant's upload while {UPLOAD_THREADS + 2} of A's waited: {took * 1000:.0f} ms")
    assert other.status_code == 200 and other.json()["bytes"] == len(line)
    assert [r.status_code for r in theirs] == [200] * (UPLOAD_THREADS + 2)
    assert all(r.json()["bytes"] == 2 * len(CHUNK) for r in theirs)
