"""Issue 25: what one tenant sends stays inside that tenant's limits. Batches under the same limits
as interactive requests; uploads bounded and counted as they arrive; refusals before bodies are read.

One stack of its own, with small limits so that each is reached in a few requests."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from ops.harness import side_redis
from tests.conftest import MODEL, TEST_DB, Stack, running_stack, wait_for

# A database and Redis db of their own: a second stack on the session's would drop its database
# (every later test got 401s) and share its dispatcher, which knows none of these limits.
LIMITS_DB = TEST_DB.rsplit("/", 1)[0] + "/spool_limits"
LIMITS_REDIS = side_redis("limits")

MAX_LINES = 5
MAX_ENQUEUED = 300
MAX_FILE = 3 << 20


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[Stack]:
    env = {
        "SPOOL_BATCH_MAX_LINES": str(MAX_LINES),
        "SPOOL_BATCH_MAX_ENQUEUED_TOKENS": str(MAX_ENQUEUED),
        "SPOOL_MAX_FILE_BYTES": str(MAX_FILE),
    }
    with running_stack(tmp_path_factory.mktemp("limits"), LIMITS_DB, LIMITS_REDIS, **env) as st:
        yield st


def _lines(n: int, max_tokens: int = 4, prefix: str = "req") -> bytes:
    out = []
    for i in range(n):
        body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": max_tokens, "temperature": 0}
        out.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    return ("\n".join(out) + "\n").encode()


def _batch(client, data: bytes):
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")

    def ended():
        now = client.batches.retrieve(b.id)
        return now if now.status in ("completed", "failed", "expired", "cancelled") else None

    return wait_for(ended, 180, f"batch {b.id} to end", interval=0.5)


def _client(st: Stack, key: str):
    import openai

    return openai.OpenAI(base_url=st.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_a_batch_over_the_line_cap_fails_naming_the_limit(limited):
    client = limited.openai("alpha")
    b = _batch(client, _lines(MAX_LINES + 1))
    assert b.status == "failed"
    codes = [e.code for e in b.errors.data]
    assert codes == ["batch_too_large"], b.errors
    assert "SPOOL_BATCH_MAX_LINES" in b.errors.data[0].message and str(MAX_LINES) in b.errors.data[0].message
    assert _batch(client, _lines(MAX_LINES)).status == "completed"  # at the cap: runs


def test_a_batch_over_the_enqueued_token_limit_fails_naming_the_limit(limited):
    client = limited.openai("beta")
    b = _batch(client, _lines(3, max_tokens=120))  # 3 x (prompt + 120) > 300
    assert b.status == "failed"
    assert [e.code for e in b.errors.data] == ["token_limit_exceeded"], b.errors
    assert "SPOOL_BATCH_MAX_ENQUEUED_TOKENS" in b.errors.data[0].message


def test_batch_lines_count_against_the_daily_token_quota(limited):
    key = limited.new_tenant("daily", tpd=10)  # less than any line reserves (prompt + 16)
    client = _client(limited, key)
    b = _batch(client, _lines(3, max_tokens=16))
    assert b.status == "completed" and b.request_counts.failed == 3 and b.request_counts.completed == 0
    assert b.output_file_id is None
    errors = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert len(errors) == 3
    for e in errors:
        assert e["response"]["status_code"] == 429, e
        err = e["response"]["body"]["error"]
        assert err["code"] == "rate_limit_exceeded" and "Daily token quota" in err["message"], err
    # The quota refused the lines before they ran: the tenant used no tokens.
    with limited.http(key) as http:
        usage = http.get("/v1/usage").json()
    assert sum(u.get("completion_tokens", 0) for u in usage.get("data", [usage])) == 0, usage


# -- uploads -----------------------------------------------------------------------------------------

BOUNDARY = "spoolboundary42"


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"


def _form(*parts: bytes) -> tuple[bytes, dict[str, str]]:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode(), {
        "content-type": f"multipart/form-data; boundary={BOUNDARY}"
    }


def _data(n: int) -> bytes:
    return (b"x" * 1023 + b"\n") * (n // 1024)


def test_uploads_accept_multipart_only_with_few_small_fields(limited):
    with limited.http(limited.keys["alpha"]) as http:
        r = http.post("/v1/files", json={"purpose": "batch", "file": "abc"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_type", r.text
        body, headers = _form(
            *[_part(f"f{i}", b"1") for i in range(5)], _part("purpose", b"batch"), _part("file", _data(4096), "a.jsonl")
        )
        r = http.post("/v1/files", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_fields", r.text
        assert "SPOOL_UPLOAD_MAX_FIELDS" in r.json()["error"]["message"]
        body, headers = _form(
            _part("purpose", b"batch"), _part("note", b"n" * 4096), _part("file", _data(4096), "a.jsonl")
        )
        r = http.post("/v1/files", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "field_too_long", r.text
        body, headers = _form(_part("purpose", b"batch"), _part("file", b"1", "a"), _part("file", b"2", "b"))
        r = http.post("/v1/files", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_files", r.text
        body, headers = _form(_part("purpose", b"fine-tune"), _part("file", _data(4096), "a.jsonl"))
        r = http.post("/v1/files", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "purpose", r.text
        body, headers = _form(_part("purpose", b"batch"), _part("file", _data(MAX_FILE + 4096), "big.jsonl"))
        r = http.post("/v1/files", content=body, headers=headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large", r.text
        assert "SPOOL_MAX_FILE_BYTES" in r.json()["error"]["message"]
        # Nothing of the refused uploads is kept.
        names = {f["filename"] for f in http.get("/v1/files").json()["data"]}
        assert not names & {"a.jsonl", "big.jsonl", "a", "b"}, names


def test_concurrent_uploads_cannot_all_pass_through_the_same_room(limited):
    """Upload A stops half-way (1.5 MiB sent, 1 MiB stored); upload B (2 MiB) then needs room that A
    has reserved: refused. Before, each upload compared itself with what was stored when it began,
    so both passed and the tenant kept more than its quota."""
    from sqlalchemy import create_engine, text

    quota = (5 << 20) // 2  # 2.5 MiB
    key = limited.new_tenant("roomy", max_storage_bytes=quota)
    release = threading.Event()
    whole, headers = _form(_part("purpose", b"batch"), _part("file", _data(2 << 20), "a.jsonl"))
    head, rest = whole[: (3 << 20) // 2], whole[(3 << 20) // 2 :]

    def slow_body():
        yield head
        release.wait(120)
        yield rest

    result: dict[str, httpx.Response] = {}

    def upload_a() -> None:
        with limited.http(key) as http:
            result["a"] = http.post("/v1/files", content=slow_body(), headers=headers)

    t = threading.Thread(target=upload_a)
    t.start()
    engine = create_engine(LIMITS_DB)
    try:

        def a_reserved() -> bool:
            with engine.connect() as c:
                return bool(
                    c.scalar(text("SELECT count(*) FROM files WHERE status = 'uploading' AND bytes >= 1048576"))
                )

        wait_for(a_reserved, 60, "upload A's first chunk stored")
        with limited.http(key) as http:
            body, headers_b = _form(_part("purpose", b"batch"), _part("file", _data(2 << 20), "b.jsonl"))
            b = http.post("/v1/files", content=body, headers=headers_b)
        assert b.status_code == 413 and b.json()["error"]["code"] == "storage_quota_exceeded", b.text
    finally:
        release.set()
        t.join(120)
    assert result["a"].status_code == 200, result["a"].text
    with engine.connect() as c:
        kept = c.scalar(
            text(
                "SELECT sum(f.bytes) FROM files f JOIN tenants t ON t.id = f.tenant_id "
                "WHERE t.name = 'roomy' AND NOT f.deleted"
            )
        )
        leftovers = c.scalar(text("SELECT count(*) FROM files WHERE status = 'uploading'"))
    engine.dispose()
    assert kept == 2 << 20 and leftovers == 0


# -- cheap refusals ------------------------------------------------------------------------------------


def test_requests_per_minute_are_checked_before_the_body_is_read(limited):
    key = limited.new_tenant("hasty", rpm=2)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    async_ = {"Prefer": "respond-async"}
    with limited.http(key) as http:
        # Taken once per request: the gate's take and admission's are not counted twice.
        for _ in range(2):
            r = http.post("/v1/completions", json=body, headers=async_)
            assert r.status_code == 202, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "2"
        # Spent: refused before the body is parsed (this one is not even JSON, and 4 MiB long).
        r = http.post(
            "/v1/completions", content=b"{" + b"x" * (4 << 20), headers={**async_, "content-type": "application/json"}
        )
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "requests per minute" in err["message"], err
        assert int(r.headers["retry-after"]) >= 1
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert r.status_code == 429, r.text
    with limited.http(limited.keys["alpha"]) as other:  # another tenant is untouched
        assert other.post("/v1/completions", json=body, headers=async_).status_code == 202
