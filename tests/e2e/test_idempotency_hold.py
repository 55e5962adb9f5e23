"""Idempotency-Key holds, against real processes: a key whose request died is taken over by exactly
one of many simultaneous retries; a request still working keeps its key however long it takes; a
request paused past its hold and taken over creates nothing; a file's fingerprint is its content.

A first request is held between taking its key and storing its job the way a slow database holds
it: the test keeps the `jobs` table locked (SHARE mode: every INSERT waits) for as long as it needs."""

from __future__ import annotations

import io
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from sqlalchemy import text

from tests.conftest import MODEL, wait_for
from tests.helpers import api_replica, tenant_rows

# wallclock: waits out a held key's lock (16 s of wall, 9 s of CPU in a shard)
# ops/test.sh runs it beside the CPU-bound shards.
pytestmark = pytest.mark.wallclock

BODY = {"model": MODEL, "prompt": "Say hi.", "max_tokens": 2, "temperature": 0}
ASYNC = {"Prefer": "respond-async"}


@pytest.fixture(scope="module")
def short_hold(stack) -> Iterator[tuple[str, object]]:
    """An API replica whose requests hold their keys for 2 s between renewals."""
    url, proc = api_replica(stack, "api-hold2", SPOOL_IDEMPOTENCY_LOCK_S="2")
    yield url, proc
    proc.terminate()  # type: ignore[attr-defined]


@contextmanager
def jobs_locked(db) -> Iterator[None]:
    """Every INSERT into jobs waits until the block ends."""
    conn = db.connect()
    tx = conn.begin()
    conn.execute(text("LOCK TABLE jobs IN SHARE MODE"))
    try:
        yield
    finally:
        tx.commit()
        conn.close()


def _jobs_of(db, tenant: str) -> list[str]:
    return [r["id"] for r in tenant_rows(db, tenant, "jobs", "x.id")]


def _key_taken(db, key: str) -> bool:
    with db.connect() as conn:
        return conn.scalar(text("SELECT count(*) FROM idempotency_keys WHERE key = :k"), {"k": key}) == 1


def _insert_waiting(db) -> bool:
    with db.connect() as conn:
        return bool(
            conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query ILIKE 'INSERT INTO jobs%' AND datname = current_database()"  # not another shard's
                )
            )
        )


def _post(url: str, key: str, idem: str, timeout: float = 120) -> httpx.Response:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout) as http:
        return http.post("/v1/completions", json=BODY, headers={**ASYNC, "Idempotency-Key": idem})


def _in_background(fn, *args) -> tuple[threading.Thread, list]:
    """Run `fn(*args)` on a thread; its answer (or the exception it raised) lands in the list."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except Exception as exc:  # the process serving it was killed, say
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_simultaneous_takeovers_of_a_dead_requests_key_create_one_job(stack, db):
    tenant = "idem-takeover"
    key = stack.new_tenant(tenant)
    idem = str(uuid.uuid4())
    # The first request takes the key, then its API process dies before the job is stored.
    url, doomed = api_replica(stack, "api-doomed")
    with jobs_locked(db):
        _in_background(_post, url, key, idem, 30)
        wait_for(lambda: _key_taken(db, idem) and _insert_waiting(db), 30, "the first request to take its key")
        doomed.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
        doomed.wait(10)  # type: ignore[attr-defined]
    assert _jobs_of(db, tenant) == []
    # Its hold lapses (the database's clock moved on by a couple of minutes, as far as the key knows).
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE idempotency_keys SET created_at = now() - interval '2 minutes', "
                "locked_until = now() - interval '1 minute' WHERE key = :k"
            ),
            {"k": idem},
        )

    # Eight retries at once: one takes the key over and stores the job; the others are told to wait.
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post(stack.base_url, key, idem), range(8)))
    codes = sorted(r.status_code for r in answers)
    created = [r.json()["id"] for r in answers if r.status_code in (200, 202)]
    assert len(_jobs_of(db, tenant)) == 1, codes
    assert set(codes) <= {200, 202, 409} and created and set(created) == set(_jobs_of(db, tenant)), codes
    # A later retry gets that one job.
    again = _post(stack.base_url, key, idem)
    assert again.json()["id"] == _jobs_of(db, tenant)[0]


def test_a_request_still_working_past_its_hold_keeps_its_key(stack, db, short_hold):
    """The first request is held up for several hold windows; it keeps renewing its key, so a retry
    meanwhile is a 409 (the SDK retries later), not a takeover and a second job."""
    url, _ = short_hold
    tenant = "idem-renewed"
    key = stack.new_tenant(tenant)
    idem = str(uuid.uuid4())
    with jobs_locked(db):
        first, first_out = _in_background(_post, url, key, idem)
        wait_for(lambda: _key_taken(db, idem) and _insert_waiting(db), 30, "the first request to take its key")
        time.sleep(5)  # 2.5 hold windows: without renewals the key would look abandoned
        retry, retry_out = _in_background(_post, url, key, idem)
        retry.join(20)  # a takeover would wait on the locked table: the retry would not answer
        answered_while_first_worked = list(retry_out)
    first.join(60)
    retry.join(60)
    assert answered_while_first_worked, "the retry took the key over and waited to store a second job"
    r = answered_while_first_worked[0]
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_in_progress", r.text
    assert first_out[0].status_code == 202, first_out[0].text
    assert _jobs_of(db, tenant) == [first_out[0].json()["id"]]
    assert _post(url, key, idem).json()["id"] == first_out[0].json()["id"]  # the retry, later: the same job


def test_a_request_paused_past_its_hold_and_taken_over_creates_nothing(stack, db, short_hold):
    """A paused API process (its request cannot renew) loses the key to a retry; when it resumes, its
    record no longer matches, its transaction is rolled back and it answers 409: one job."""
    tenant = "idem-fenced"
    key = stack.new_tenant(tenant)
    idem = str(uuid.uuid4())
    url, proc = api_replica(stack, "api-paused", SPOOL_IDEMPOTENCY_LOCK_S="2")
    try:
        with jobs_locked(db):
            first, first_out = _in_background(_post, url, key, idem)
            wait_for(lambda: _key_taken(db, idem) and _insert_waiting(db), 30, "the first request to take its key")
            proc.send_signal(signal.SIGSTOP)  # type: ignore[attr-defined]
        # Its job row is inserted but not committed; its hold lapses while it is paused.
        wait_for(lambda: _post(stack.base_url, key, idem).status_code == 202, 30, "a retry to take the key over")
        proc.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]
        first.join(60)
        assert first_out[0].status_code == 409, first_out[0].text
        jobs = _jobs_of(db, tenant)
        assert len(jobs) == 1
        assert _post(url, key, idem).json()["id"] == jobs[0]
    finally:
        proc.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]
        proc.terminate()  # type: ignore[attr-defined]


def test_another_file_of_the_same_name_and_size_under_the_same_key_is_refused(stack, db):
    key = stack.new_tenant("idem-file-content")
    idem = {"Idempotency-Key": str(uuid.uuid4())}
    with stack.http(key) as http:

        def upload(content: bytes) -> httpx.Response:
            return http.post(
                "/v1/files",
                files={"file": ("same.jsonl", io.BytesIO(content))},
                data={"purpose": "batch"},
                headers=idem,
            )

        first = upload(b'{"a": 1}\n')
        assert first.status_code == 200, first.text
        assert upload(b'{"a": 1}\n').json()["id"] == first.json()["id"]  # the same request: the same file
        other = upload(b'{"b": 2}\n')  # same name, same size, other content
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused", other.text
