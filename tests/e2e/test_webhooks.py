"""Batch webhooks: Standard Webhooks signatures with per-tenant secrets, retries, and delivery from a
Celery task behind an address guard, so that a receiver can neither stall Spool nor steer it."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import text

from core.batches.webhooks import verify
from tests.conftest import wait_for
from tests.e2e.test_batches import _lines, _poll


@contextmanager
def receiver(answer) -> Iterator[tuple[str, list[tuple[bytes, dict[str, str]]]]]:
    """A local HTTP receiver; `answer(n)` runs for the n-th POST and returns (status, headers)."""
    received: list[tuple[bytes, dict[str, str]]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # http.server calls it by this name
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((body, {k.lower(): v for k, v in self.headers.items()}))
            status, headers = answer(len(received))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", received
    finally:
        server.shutdown()


def _batch(client, url: str | None, n: int = 2):
    f = client.files.create(file=("hook.jsonl", io.BytesIO(_lines(n, max_tokens=1))), purpose="batch")
    extra = {"webhook_url": url} if url else {}
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", extra_body=extra
    )


def _secret(stack, tenant: str) -> str:
    with stack.http(stack.keys[tenant]) as http:
        r = http.get("/v1/webhooks/secret")
        assert r.status_code == 200, r.text
        return r.json()["secret"]


def _webhook_state(db, batch_id: str) -> dict:
    with db.connect() as conn:
        return conn.scalar(text("SELECT webhook_state FROM batches WHERE id = :i"), {"i": batch_id}) or {}


def test_webhook_is_signed_with_the_tenants_own_secret_and_retried(stack, db):
    with receiver(lambda n: (500 if n == 1 else 200, {})) as (url, received):  # the first delivery fails
        client = stack.openai()
        b = _batch(client, url)
        _poll(client, b.id, {"completed"})
        wait_for(lambda: len(received) >= 2, 60, "the retried webhook")
        mine, theirs = _secret(stack, "alpha"), _secret(stack, "beta")
        assert mine != theirs and mine.startswith("whsec_")
        for body, headers in received[:2]:
            assert verify(mine, body, headers)  # Standard Webhooks' own verifier
            assert not verify(theirs, body, headers)  # another tenant's secret does not sign it
            event = json.loads(body)
            assert event["type"] == "batch.completed" and event["data"]["id"] == b.id
        assert received[0][1]["webhook-id"] == received[1][1]["webhook-id"]  # one event id across retries
        wait_for(lambda: "delivered" in _webhook_state(db, b.id), 10, "delivery recorded")
        assert len(received) == 2  # delivered once it got a 2xx: no more calls


def test_rotating_the_secret_signs_later_deliveries_with_the_new_one(stack):
    old = _secret(stack, "beta")
    with stack.http(stack.keys["beta"]) as http:
        new = http.post("/v1/webhooks/secret").json()["secret"]
    assert new != old and _secret(stack, "beta") == new
    with receiver(lambda n: (204, {})) as (url, received):
        client = stack.openai("beta")
        b = _batch(client, url)
        _poll(client, b.id, {"completed"})
        wait_for(lambda: received, 60, "the webhook")
        body, headers = received[0]
        assert verify(new, body, headers) and not verify(old, body, headers)


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
        "http://10.1.2.3/hook",  # private
        "http://[::1]:8080/hook",  # loopback (v6), not in this stack's allowlist
        "http://user:pw@example.com/hook",  # credentials in the URL
        "ftp://example.com/hook",  # not http(s)
    ],
)
def test_webhook_urls_to_internal_addresses_are_refused_at_submit(stack, url):
    with stack.http(stack.keys["alpha"]) as http:
        f = http.post("/v1/files", files={"file": ("x.jsonl", _lines(1))}, data={"purpose": "batch"}).json()
        r = http.post(
            "/v1/batches",
            json={
                "input_file_id": f["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "webhook_url": url,
            },
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "webhook_url"
    assert "Traceback" not in r.text


def test_redirects_are_not_followed(stack, db):
    with receiver(lambda n: (204, {})) as (target, hit):
        with receiver(lambda n: (307, {"location": target})) as (url, _):
            client = stack.openai()
            b = _batch(client, url)
            _poll(client, b.id, {"completed"})
            wait_for(lambda: _webhook_state(db, b.id).get("last_status") == 307, 60, "the redirected attempt")
        assert hit == []  # the redirect target was never called
    assert "delivered" not in _webhook_state(db, b.id)


def test_a_slow_receiver_holds_up_neither_dispatching_nor_other_work(stack, db):
    """The receiver holds its connection open past the delivery deadline. Meanwhile another batch runs
    to completion (the dispatcher keeps dispatching), and the attempt ends at the deadline."""
    release = threading.Event()
    answered = threading.Event()

    def hang(n):
        release.wait(60)
        answered.set()
        return 200, {}

    with receiver(hang) as (url, received):
        client = stack.openai()
        slow = _batch(client, url)
        _poll(client, slow.id, {"completed"})
        wait_for(lambda: received, 60, "the slow delivery to start")
        other = _batch(client, None, n=3)
        assert _poll(client, other.id, {"completed"}).request_counts.completed == 3
        assert not answered.is_set()  # all of that happened while the receiver still held its request
        # Past SPOOL_WEBHOOK_TIMEOUT_S (4 s here) the attempt is over and recorded as a failure to retry.
        state = wait_for(
            lambda: _webhook_state(db, slow.id).get("last_error") and _webhook_state(db, slow.id), 30, "deadline"
        )
        # httpx's read timeout or the one deadline over the exchange, whichever fires first.
        assert state["last_error"] in ("ReadTimeout", "no answer within 4 s") and state["attempts"] >= 1
        release.set()
