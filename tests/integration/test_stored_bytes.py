"""Every byte stored for a tenant is counted to it and bounded by its limits (issue 49): its jobs'
and batches' rows in Postgres (requests, Responses input items, instructions and tools, results),
its files, and what its ended jobs hold in Redis. Before, a job's stored request and result were
counted against nothing (~8 MiB a request, kept 30 days) and Redis bytes had no quota.

The API's error handlers and its completions, responses and usage routes run in-process, wired as
api/app.py wires them (a stand-in tokenizer with a chat template, a recorder for the broker), on the
integration tests' own Postgres and Redis; authentication (api/guard.py) is stood in for by setting
the principal it would have found. The counts are the migration's triggers' (0014)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY, generate_latest
from sqlalchemy import create_engine, delete, func, select, text, update
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from api import deps, errors
from api.routes import admin, completions, responses, usage
from core.batches import ingest
from core.config import Settings
from core.dispatcher import Dispatcher
from core.files import storage
from core.generation.events import ChoiceResult, Delta, JobResult, Usage
from core.idempotency import Idempotency
from core.infra import kv
from core.infra.orm import Batch, File, Job, Tenant, TenantStored
from core.infra.streams import write
from core.jobs import live_workers, transitions
from core.jobs.lifecycle import Lifecycle
from core.jobs.responses import Responses
from core.protocol import render
from core.states import BatchStatus, JobState
from core.tenancy import quota
from core.tenancy import service as tenancy
from core.tenancy import usage as redis_usage
from core.tenancy.keys import Principal
from ops import factories
from tests.integration.conftest import IT_DB, IT_REDIS
from tests.integration.test_create_completion import Broker
from tests.integration.test_response_chains import ChatTokenizer

MODEL = "smollm2-135m-instruct"


def _stored(session, tenant_id: int) -> int:
    """The tenant's running total, as admission reads it."""
    session.expire_all()
    return int(session.scalar(quota.stored_of(tenant_id)) or 0)


def _rows(session, tenant_id: int) -> int:
    """The same, summed from the rows themselves (what the total must always equal)."""
    return int(
        session.scalar(select(func.coalesce(func.sum(Job.stored_bytes), 0)).where(Job.tenant_id == tenant_id)) or 0
    ) + int(
        session.scalar(select(func.coalesce(func.sum(Batch.stored_bytes), 0)).where(Batch.tenant_id == tenant_id)) or 0
    )


def _jobs(session, tenant_id: int) -> int:
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id)) or 0


# -- the count -------------------------------------------------------------------------------------


def test_each_row_counts_what_it_stores_to_its_tenant(session, sessions, rds, it_settings):
    t, other = factories.tenant(session), factories.tenant(session)
    big = "x" * 200_000
    j = factories.job(session, t, prompts=[{"ids": None, "text": big}])
    small = factories.job(session, t)
    factories.job(session, other)
    session.expire_all()
    row = session.get(Job, j.id)
    # The request's JSON bytes, uncompressed (Postgres keeps this row's prompt as ~2 KB of pglz).
    assert 200_000 < row.stored_bytes < 201_000, row.stored_bytes
    assert session.scalar(text("SELECT pg_column_size(prompts) FROM jobs WHERE id = :id"), {"id": j.id}) < 10_000
    first = _stored(session, t.id)
    assert first == row.stored_bytes + session.get(Job, small.id).stored_bytes == _rows(session, t.id)
    assert _stored(session, other.id) == _rows(session, other.id) > 0

    # Its ending adds what it wrote (the result), never the request again.
    running = factories.job(session, t, state=JobState.running, lease_s=60)
    before = _stored(session, t.id)
    answer = "y" * 50_000
    lc = Lifecycle(sessions, rds, it_settings)
    result = JobResult(choices=[ChoiceResult(index=0, text=answer, finish_reason="stop")])
    assert lc.succeed(running, result, Usage(prompt_tokens=3, completion_tokens=5), 0.01)
    grown = _stored(session, t.id) - before
    assert 50_000 < grown < 51_000, grown
    assert _stored(session, t.id) == _rows(session, t.id)

    # A deleted response drops its input items, and their bytes with them.
    items = [{"type": "message", "role": "user", "content": "z" * 100_000}]
    resp = factories.job(session, t, chat={"response": {"input": items, "store": True, "background": False}})
    before = _stored(session, t.id)
    session.execute(transitions.FORGET_RESPONSE, {"id": resp.id, "tenant": t.id})
    session.commit()
    assert 100_000 < before - _stored(session, t.id) < 100_500
    assert _stored(session, t.id) == _rows(session, t.id)

    # Rows removed (retention's DELETE, one statement for many) take their bytes with them.
    session.execute(delete(Job).where(Job.tenant_id == t.id))
    session.commit()
    assert _stored(session, t.id) == 0


def test_a_batch_object_counts_its_metadata(session):
    t = factories.tenant(session)
    meta = {f"k{i}": "m" * 500 for i in range(16)}
    b = factories.batch(session, t, status=BatchStatus.completed, meta=meta)
    session.expire_all()
    assert 8_000 < session.get(Batch, b.id).stored_bytes < 9_000
    assert _stored(session, t.id) == _rows(session, t.id) > 8_000


# -- the API: quotas, usage ------------------------------------------------------------------------


class Api:
    def __init__(self, settings: Settings, principal: Principal) -> None:
        # A context long enough for the stand-in tokenizer's one token per character.
        self.settings, self.principal = settings.model_copy(update={"n_ctx": 1 << 20}), principal

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return asyncio.run(self._call(method, path, **kw))

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        app = FastAPI()
        errors.install(app)
        for r in (completions.router, responses.router, usage.router, admin.router):
            app.include_router(r)
        app.dependency_overrides[deps.settings] = lambda: self.settings
        engine = create_async_engine(IT_DB)
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        rds = kv.async_client(IT_REDIS, decode_responses=True)
        tok = ChatTokenizer()
        st = app.state
        st.redis, st.async_sessions, st.hub, st.lifecycle = rds, sessions, None, None
        sync_engine = create_engine(IT_DB)
        st.sync_sessions, st.sync_redis = sessionmaker(sync_engine), kv.client(IT_REDIS)
        st.fingerprints = render.Fingerprints(self.settings)
        keys = Idempotency(sessions, lock_s=30.0)
        st.completions = completions_ = Responses(sessions, rds, self.settings, keys, Broker(), lambda _m: tok)
        st.responses = completions_

        async def asgi(scope, receive, send):
            if scope["type"] == "http":
                scope.setdefault("state", {})["principal"] = self.principal  # what api/guard.py sets
            await app(scope, receive, send)

        try:
            transport = httpx.ASGITransport(app=asgi, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://spool") as client:
                return await client.request(method, path, **kw)
        finally:
            await rds.aclose()
            await engine.dispose()
            st.sync_redis.close()
            sync_engine.dispose()


@pytest.fixture
def caller(session, rds) -> Iterator[Principal]:
    t = factories.tenant(session, max_stored_bytes=64_000)
    _, k = factories.api_key(session, t)
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    yield Principal(tenant=t, key=k)


ASYNC = {"prefer": "respond-async"}


def test_a_completion_past_the_stored_quota_is_a_413_and_stores_nothing(session, it_settings, caller):
    api = Api(it_settings, caller)
    ok = api.call(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "a" * 5_000, "max_tokens": 2}, headers=ASYNC
    )
    assert ok.status_code == 202, ok.text
    used = _stored(session, caller.tenant.id)
    assert 20_000 < used < 64_000  # the prompt's token ids (4 bytes a token as JSON text)

    over = api.call(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "b" * 15_000, "max_tokens": 2}, headers=ASYNC
    )
    assert over.status_code == 413, over.text
    err = over.json()["error"]
    assert err["code"] == "storage_quota_exceeded" and err["type"] == "invalid_request_error", err
    assert "64000 bytes" in err["message"] and "max_stored_bytes" in err["message"], err
    assert _jobs(session, caller.tenant.id) == 1 and _stored(session, caller.tenant.id) == used


def test_a_response_with_large_instructions_past_the_quota_is_a_413(session, it_settings, caller):
    api = Api(it_settings, caller)
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "background": True}
    ok = api.call("POST", "/v1/responses", json=body)
    assert ok.status_code == 200, ok.text
    used = _stored(session, caller.tenant.id)
    # 30 KB of `instructions` store ~150 KB: in the response's settings, in the templated prompt and as
    # its token ids (one a character with this tokenizer, ~4 bytes each as JSON).
    over = api.call("POST", "/v1/responses", json={**body, "instructions": "Be brief. " * 3_000})
    assert over.status_code == 413, over.text
    err = over.json()["error"]
    assert err["code"] == "storage_quota_exceeded" and "max_stored_bytes" in err["message"], err
    assert _jobs(session, caller.tenant.id) == 1 and _stored(session, caller.tenant.id) == used

    # 0: no limit for this tenant. The same request is stored, and its bytes counted.
    caller.tenant.max_stored_bytes = 0  # what the key lookup reads once /admin sets it
    again = api.call("POST", "/v1/responses", json={**body, "instructions": "Be brief. " * 3_000})
    assert again.status_code == 200, again.text
    assert _stored(session, caller.tenant.id) - used > 60_000


def _streamed(lc: Lifecycle, session, t, words: list[str]) -> Job:
    """A job as a worker runs it and ends it: its stream and marks stay, counted to its tenant."""
    j = factories.job(session, t, state=JobState.running, lease_s=60)
    write.raise_fence(lc.redis, j.id, 1, lc.settings.events_ttl_s)
    deltas = [Delta(attempt=1, choice=0, text=w, token_ids=[i], finish_reason=None) for i, w in enumerate(words)]
    lc.publish_deltas(j.id, 1, deltas, start=1)
    result = JobResult(choices=[ChoiceResult(index=0, text="".join(words), finish_reason="stop")])
    assert lc.succeed(j, result, Usage(prompt_tokens=3, completion_tokens=len(words)), 0.01)
    return j


def test_a_tenant_at_its_redis_quota_gets_a_429(session, sessions, rds, it_settings, caller):
    lc = Lifecycle(sessions, rds, it_settings)
    _streamed(lc, session, caller.tenant, [" one", " two"])
    held = redis_usage.redis_bytes(rds, it_settings.ended_events_ttl_s)[caller.tenant.id]
    assert held > 4096
    session.execute(update(Tenant).where(Tenant.id == caller.tenant.id).values(max_redis_bytes=held))
    session.commit()
    caller.tenant.max_redis_bytes = held  # what the key lookup would read now
    before = _jobs(session, caller.tenant.id)
    r = Api(it_settings, caller).call(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=ASYNC
    )
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "redis_quota_exceeded" and "max_redis_bytes" in err["message"] and str(held) in err["message"]
    assert 1 <= int(r.headers["retry-after"]) <= it_settings.ended_events_ttl_s
    assert _jobs(session, caller.tenant.id) == before

    caller.tenant.max_redis_bytes = 0  # no limit
    r = Api(it_settings, caller).call(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=ASYNC
    )
    assert r.status_code == 202, r.text


def test_usage_and_metrics_show_each_store(session, sessions, rds, it_settings, caller):
    t = caller.tenant
    api = Api(it_settings, caller)
    assert (
        api.call(
            "POST", "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}, headers=ASYNC
        ).status_code
        == 202
    )
    fid = storage.new_file_id()
    session.add(File(id=fid, tenant_id=t.id, purpose="batch", filename="in.jsonl", bytes=1234, lines=1))
    session.commit()
    _streamed(Lifecycle(sessions, rds, it_settings), session, t, [" a"])
    jobs, redis = _stored(session, t.id), redis_usage.redis_bytes(rds, it_settings.ended_events_ttl_s)[t.id]

    got = api.call("GET", "/v1/usage")
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["stored_bytes"] == {
        "jobs": jobs,
        "files": 1234,
        "redis": redis,
        "limits": {
            "jobs": 64_000,
            "files": it_settings.tenant_storage_bytes,
            "redis": it_settings.tenant_redis_bytes_limit,
        },
    }
    assert body["redis_bytes"] == redis

    # /admin/usage: every tenant's, or the one named.
    admin_key = factories.api_key(session, t, scope="admin")[1]
    got = Api(it_settings, Principal(tenant=t, key=admin_key)).call("GET", "/admin/usage", params={"tenant": t.name})
    assert got.status_code == 200, got.text
    assert got.json()["stored"] == [{"tenant_id": t.id, "jobs": jobs, "files": 1234, "redis": redis}]

    # /metrics: the dispatcher's periodic pass sets a gauge per tenant and store.
    with sessions() as s:  # the keeper's gauge pass alone (`keep_batches` also advances batches, sweeps)
        Dispatcher(sessions, rds, rds, it_settings).stored_gauges(s)
    metrics = generate_latest(REGISTRY).decode()
    for store, n in (("jobs", jobs), ("files", 1234), ("redis", redis)):
        line = f'spool_tenant_stored_bytes{{store="{store}",tenant="{t.id}"}} {float(n)}'
        assert line in metrics, (line, [m for m in metrics.splitlines() if "stored_bytes" in m][:10])


# -- a batch ---------------------------------------------------------------------------------------


def test_a_batch_whose_lines_pass_the_quota_fails_at_validation(session, sessions, it_settings):
    t = factories.tenant(session, max_stored_bytes=8_000)
    _, key = factories.api_key(session, t)
    line = {"url": "/v1/completions", "body": {"model": MODEL, "prompt": "The quick brown fox. " * 60, "max_tokens": 2}}
    bid = factories.validating_batch(session, t, key, [{"custom_id": f"r{i}", **line} for i in range(10)])
    before = _stored(session, t.id)
    assert ingest.validate(sessions, bid, it_settings) == BatchStatus.failed
    session.expire_all()
    errors_ = session.get(Batch, bid).errors["data"]
    assert [e["code"] for e in errors_] == ["storage_quota_exceeded"], errors_
    assert "8000 bytes" in errors_[0]["message"] and "max_stored_bytes" in errors_[0]["message"]
    assert session.scalar(select(func.count()).select_from(Job).where(Job.batch_id == bid)) == 0
    assert _stored(session, t.id) - before < 2_000  # the failed batch's own errors, no line

    # Under the quota, the same file is queued.
    tenancy.run(sessions, tenancy.update_tenant, t.name, tenancy.TenantLimits(max_stored_bytes=0))
    bid = factories.validating_batch(session, t, key, [{"custom_id": f"r{i}", **line} for i in range(10)])
    assert ingest.validate(sessions, bid, it_settings) == BatchStatus.in_progress
    assert _stored(session, t.id) > 12_600


def test_the_quotas_are_among_the_tenants_limits(session, sessions):
    t = tenancy.run(
        sessions, tenancy.create_tenant, tenancy.TenantCreate(name=f"q-{uuid.uuid4().hex[:8]}", max_stored_bytes=5)
    )
    assert render.tenant(t)["max_stored_bytes"] == 5 and render.tenant(t)["max_redis_bytes"] is None
    t = tenancy.run(
        sessions, tenancy.update_tenant, t.name, tenancy.TenantLimits(max_stored_bytes=0, max_redis_bytes=1 << 20)
    )
    assert (t.max_stored_bytes, t.max_redis_bytes) == (0, 1 << 20)
    t = tenancy.run(sessions, tenancy.update_tenant, t.name, tenancy.TenantLimits(max_stored_bytes=None))
    assert t.max_stored_bytes is None  # the deployment's default again
    assert quota.stored_limit(t, Settings()) == Settings().tenant_stored_bytes


def test_total_is_a_few_rows_per_tenant(session):
    """Admission reads at most a slot per backend (16), whatever the number of jobs."""
    t = factories.tenant(session)
    for _ in range(5):
        factories.job(session, t)
    assert session.scalar(select(func.count()).select_from(TenantStored).where(TenantStored.tenant_id == t.id)) <= 16
