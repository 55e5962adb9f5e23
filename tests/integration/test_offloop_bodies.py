"""Answers whose size a client controls are read, built and encoded off the API's event loop (issue
35): `GET /v1/batches` over batches with big metadata (3.2 s and +650 MiB on the loop), a batch, the
files list and a file, and /tokenize (2M tokens with pieces held a process 9 s; pieces are now
bounded). Driven over HTTP against the in-process API of tests/integration/test_downloads.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from api import bodies
from api.routes.tokens import MAX_PIECES
from core.infra.orm import Tenant
from core.protocol.schemas import BatchList, BatchObject, FileList, FileObject
from ops import factories
from tests.helpers import threads_of
from tests.integration.test_downloads import Server, api_server, stored_file, tenant_key  # noqa: F401


@dataclass
class Api:
    """The in-process API, a client of a new tenant's on it, and the threads api/bodies.encode ran on
    in this test."""

    server: Server
    tenant_id: int
    http: httpx.Client
    encodes: list[int]


@pytest.fixture
def api(api_server: Server, sessions: sessionmaker[Session], monkeypatch) -> Iterator[Api]:  # noqa: F811
    tid, key = tenant_key(sessions)
    with httpx.Client(base_url=api_server.base, headers={"authorization": f"Bearer {key}"}, timeout=60) as http:
        yield Api(api_server, tid, http, threads_of(monkeypatch, bodies, "encode"))


def _health_during(server: Server, request) -> tuple[httpx.Response, float]:
    """`request()`'s answer, and the slowest /health the loop answered meanwhile (measured, not asserted)."""
    worst, done = 0.0, threading.Event()

    def probe() -> None:
        nonlocal worst
        with httpx.Client(base_url=server.base, timeout=30) as c:
            while not done.is_set():
                t = time.monotonic()
                c.get("/health")
                worst = max(worst, time.monotonic() - t)

    with ThreadPoolExecutor(1) as pool:
        probing = pool.submit(probe)
        try:
            return request(), worst
        finally:
            done.set()
            probing.result()


def test_batches_with_big_metadata_are_listed_and_retrieved_off_the_loop(api: Api, sessions: sessionmaker[Session]):
    meta = {f"k{i}": chr(ord("a") + i) * (1 << 20) for i in range(4)}  # 4 MiB, past any API cap: stored directly
    with sessions() as s:
        t = s.get(Tenant, api.tenant_id)
        ids = [factories.batch(s, t, meta=meta).id for _ in range(5)]
    got, worst = _health_during(api.server, lambda: api.http.get("/v1/batches", params={"limit": 10}))
    assert got.status_code == 200 and got.headers["content-type"] == "application/json"
    page = BatchList.model_validate(got.json())
    assert [b.id for b in page.data] == ids[::-1] and not page.has_more
    assert all(b.metadata == meta for b in page.data)  # type: ignore[attr-defined]
    assert page.first_id == ids[-1] and page.last_id == ids[0]
    print(
        f"GET /v1/batches, 5 x 4 MiB metadata: {len(got.content) >> 20} MiB;"
        f" slowest /health meanwhile {worst * 1000:.0f} ms"
    )

    one = api.http.get(f"/v1/batches/{ids[0]}")
    assert one.status_code == 200 and BatchObject.model_validate(one.json()).id == ids[0]
    assert one.json()["metadata"] == meta
    after = api.http.get("/v1/batches", params={"limit": 2, "after": ids[3]})
    assert [b["id"] for b in after.json()["data"]] == [ids[2], ids[1]] and after.json()["has_more"] is True
    missing = api.http.get("/v1/batches/batch_nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "batch_not_found"
    # another tenant sees none of them
    _, other = tenant_key(sessions)
    theirs = httpx.get(f"{api.server.base}/v1/batches/{ids[0]}", headers={"authorization": f"Bearer {other}"})
    assert theirs.status_code == 404

    assert len(api.encodes) >= 3 and api.server.loop_thread not in api.encodes


def test_files_are_listed_and_retrieved_off_the_loop(api: Api, sessions: sessionmaker[Session]):
    fids = [stored_file(sessions, api.tenant_id, 1) for _ in range(3)]
    listed = api.http.get("/v1/files")
    assert listed.status_code == 200
    page = FileList.model_validate(listed.json())
    assert [f.id for f in page.data] == fids[::-1]
    asc = api.http.get("/v1/files", params={"order": "asc", "after": fids[0]}).json()
    assert [f["id"] for f in asc["data"]] == fids[1:]
    one = api.http.get(f"/v1/files/{fids[1]}")
    assert one.status_code == 200 and FileObject.model_validate(one.json()).bytes == 1 << 20
    gone = api.http.delete(f"/v1/files/{fids[1]}")
    assert gone.status_code == 200 and gone.json() == {"id": fids[1], "object": "file", "deleted": True}
    missing = api.http.get(f"/v1/files/{fids[1]}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"
    assert len(api.encodes) == 3 and api.server.loop_thread not in api.encodes


def test_tokenize_pieces_are_bounded_and_answers_built_off_the_loop(api: Api):
    over = " hello" * (MAX_PIECES + 1)  # one token per word
    refused = api.http.post("/tokenize", json={"content": over, "with_pieces": True})
    assert refused.status_code == 400
    err = refused.json()["error"]
    assert err["param"] == "with_pieces" and err["code"] == "too_many_tokens" and str(MAX_PIECES) in err["message"]

    ids, worst = _health_during(api.server, lambda: api.http.post("/tokenize", json={"content": over * 8}))
    assert ids.status_code == 200 and len(ids.json()["tokens"]) == 8 * (MAX_PIECES + 1)
    print(f"/tokenize of {len(over) * 8 >> 20} MiB, ids only: slowest /health meanwhile {worst * 1000:.0f} ms")

    pieces = api.http.post("/tokenize", json={"content": " hello" * MAX_PIECES, "with_pieces": True})
    assert pieces.status_code == 200
    tokens = pieces.json()["tokens"]
    assert len(tokens) == MAX_PIECES and tokens[-1]["piece"] == " hello"
    back = api.http.post("/detokenize", json={"tokens": [t["id"] for t in tokens[:3]]})
    assert back.status_code == 200 and back.json() == {"content": " hello hello hello"}
    assert len(api.encodes) == 3 and api.server.loop_thread not in api.encodes
