"""Idempotency-Key: a retried POST gets the original outcome, never a second job, file or batch."""

from __future__ import annotations

import functools
import io
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from tests.conftest import MODEL
from tests.helpers import Relay, pipe, tcp_proxy, tenant_rows
from tests.sse import collect


def _jobs_of(db, tenant: str) -> int:
    return len(tenant_rows(db, tenant, "jobs", "x.id"))


def test_same_key_same_body_is_one_job_and_the_same_answer(stack, db):
    key = stack.new_tenant("idem-same")
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.7}
    k = {"Idempotency-Key": str(uuid.uuid4())}
    with stack.http(key) as http:
        first = http.post("/v1/completions", json=body, headers=k)
        again = http.post("/v1/completions", json=dict(reversed(body.items())), headers=k)  # re-serialized
        assert first.status_code == again.status_code == 200
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()  # same id, same (sampled) text
        # A retried stream re-attaches to the same job from its start.
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=k) as resp:
            assert resp.status_code == 422  # a different request (stream) under the same key
    assert _jobs_of(db, "idem-same") == 1


def test_same_key_other_body_is_422_and_keys_are_per_tenant(stack, db):
    a, b = stack.new_tenant("idem-a"), stack.new_tenant("idem-b")
    k = {"Idempotency-Key": "shared-key"}
    with stack.http(a) as ha, stack.http(b) as hb:
        assert ha.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, headers=k).is_success
        r = ha.post("/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 1}, headers=k)
        assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"
        # Another tenant's identical key is its own.
        assert hb.post("/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 1}, headers=k).is_success
    assert _jobs_of(db, "idem-a") == 1 and _jobs_of(db, "idem-b") == 1


def test_a_refused_request_frees_its_key(stack):
    k = {"Idempotency-Key": str(uuid.uuid4())}
    with stack.http(stack.keys["alpha"]) as http:
        bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -5}, headers=k)
        assert bad.status_code == 400
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, headers=k)
        assert ok.status_code == 200


def test_stream_retry_reattaches_to_the_same_job(stack, db):
    key = stack.new_tenant("idem-stream")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "stream": True}
    k = {"Idempotency-Key": str(uuid.uuid4())}
    texts = []
    with stack.http(key) as http:
        for _ in range(2):
            with http.stream("POST", "/v1/completions", json=body, headers=k) as resp:
                evs, done = collect(resp)
            assert done
            texts.append("".join(e.json["choices"][0]["text"] for e in evs if e.json.get("choices")))
    assert texts[0] == texts[1] and texts[0]
    assert _jobs_of(db, "idem-stream") == 1


@contextmanager
def dropping_proxy(port: int, drops: int) -> Iterator[str]:
    """A TCP proxy to the API that, on its first `drops` connections, forwards the request and then
    hangs up as soon as the answer starts: the server did the work, the client never hears of it."""

    def relays(n: int) -> tuple[Relay, Relay]:
        return pipe, functools.partial(pipe, drop=n < drops)

    with tcp_proxy("127.0.0.1", port, relays) as proxy_port:
        yield f"http://127.0.0.1:{proxy_port}"


@pytest.mark.parametrize("kind", ["completion", "stream", "file", "batch"])
def test_openai_client_whose_first_answer_is_lost_creates_exactly_one(stack, db, kind):
    tenant = f"idem-proxy-{kind}"
    key = stack.new_tenant(tenant)
    with dropping_proxy(stack.port, drops=1) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=3, timeout=60)
        h = {"Idempotency-Key": str(uuid.uuid4())}
        if kind == "completion":
            r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_headers=h)
            assert r.choices[0].text is not None
        elif kind == "stream":
            chunks = list(
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True, extra_headers=h)
            )
            assert chunks
        elif kind == "file":
            client.files.create(file=("a.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch", extra_headers=h)
        else:
            direct = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
            f = direct.files.create(file=("b.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
            client.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", extra_headers=h
            )
    table = {"completion": "jobs", "stream": "jobs", "file": "files", "batch": "batches"}[kind]
    n = len(tenant_rows(db, tenant, table, "x.id"))
    assert n == 1, f"{n} {table} for one logical request"
