"""A Redis that answers but refuses writes for now (issue 35): `OOM` past `maxmemory` under
`noeviction`, `MISCONF` when it cannot persist, `READONLY` after a failover made it a replica,
`NOREPLICAS`, `MASTERDOWN`. Each is an outage: POST /v1/completions answers 503 with Retry-After
(not a 500) and stores nothing, and a worker's `retrying` waits until Redis serves again (never a
failed job). A reply error that is a bug (WRONGTYPE) stays a 500.

The refusing Redis is a server of this test's own on a free loopback port (it is misconfigured on
purpose: never the shared one); Postgres is the integration tests' own database.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from api import costs, errors
from api.request_gate import RequestRateGate
from api.routes import completions
from core.idempotency import Idempotency
from core.infra import kv, redis_keys
from core.infra.orm import Job
from core.infra.streams import keys, write
from core.infra.transient import TRANSIENT, is_transient
from core.jobs import live_workers
from core.jobs.service import Completions
from core.protocol import render
from core.tenancy.keys import Principal
from ops import factories
from ops.harness import free_port, refuse_writes, wait_for
from tests.integration.conftest import IT_DB
from tests.integration.test_create_completion import MODEL, Broker, CharTokenizer
from workers import retry

# wallclock: Redis refuses writes for seconds at a time (9 s of wall, 1 s of CPU in a shard)
# ops/test.sh runs it beside the CPU-bound shards.
pytestmark = [
    pytest.mark.wallclock,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


class OwnRedis:
    """A redis-server of this module's own, and the refusals it can be put into (and out of)."""

    def __init__(self) -> None:
        self.port, self.workdir = free_port(), Path(tempfile.mkdtemp(prefix="spool-refusals-"))
        self.data = self.workdir / "data"  # where snapshots go (`dir` cannot be changed at runtime)
        self.data.mkdir()
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
                *("--dir", str(self.data)),
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.admin = redis_lib.Redis.from_url(self.url, decode_responses=True)
        wait_for(self._pings, 10, "the test's own redis-server")

    def _pings(self) -> bool:
        try:
            return bool(self.admin.ping())
        except redis_lib.ConnectionError:
            return False

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- refusals: each puts the server into it, and returns what takes it out again -------------
    def oom(self) -> Callable[[], None]:
        return refuse_writes(self.admin, "oom", self.data)

    def misconf(self) -> Callable[[], None]:
        return refuse_writes(self.admin, "misconf", self.data)

    def reset(self) -> None:
        """Out of every refusal at once: for a refusal whose setup itself failed half-way, so that the
        module's later tests never start on a server left refusing."""
        self.data.mkdir(exist_ok=True)
        for key, value in (("save", ""), ("maxmemory", "0"), ("min-replicas-to-write", "0")):
            self.admin.config_set(key, value)
        self.admin.replicaof("NO", "ONE")
        self.admin.config_set("replica-serve-stale-data", "yes")

    def readonly(self) -> Callable[[], None]:
        self.admin.replicaof("127.0.0.1", free_port())  # a failover made it a replica (of nothing reachable)
        return lambda: self.admin.replicaof("NO", "ONE")

    def noreplicas(self) -> Callable[[], None]:
        self.admin.config_set("min-replicas-to-write", "1")
        return lambda: self.admin.config_set("min-replicas-to-write", "0")

    def masterdown(self) -> Callable[[], None]:
        self.admin.config_set("replica-serve-stale-data", "no")
        self.admin.replicaof("127.0.0.1", free_port())

        def lift() -> None:
            self.admin.replicaof("NO", "ONE")
            self.admin.config_set("replica-serve-stale-data", "yes")

        return lift


REFUSALS = {
    "oom": ("OOM", OwnRedis.oom),
    "misconf": ("MISCONF", OwnRedis.misconf),
    "readonly": ("READONLY", OwnRedis.readonly),
    "noreplicas": ("NOREPLICAS", OwnRedis.noreplicas),
    "masterdown": ("MASTERDOWN", OwnRedis.masterdown),
}


@pytest.fixture(scope="module")
def own_redis() -> Iterator[OwnRedis]:
    server = OwnRedis()
    try:
        yield server
    finally:
        server.close()


@contextmanager
def refusing(server: OwnRedis, name: str) -> Iterator[Callable[[], None]]:
    try:
        lift = REFUSALS[name][1](server)
    except BaseException:
        server.reset()
        raise
    try:
        yield lift
    finally:
        lift()


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_what_the_server_answers_is_transient(own_redis, name):
    """Off the wire, through our clients (a command, a pipeline, a Lua script): caught by `except TRANSIENT`."""
    code = REFUSALS[name][0]
    rds = kv.client(own_redis.url)
    with refusing(own_redis, name):
        refused: list[BaseException] = []
        for call in (
            lambda: rds.set("k", "v"),
            lambda: rds.pipeline(transaction=False).set("k", "v").incr("n").execute(),
            lambda: kv.Lua("return redis.call('SET', KEYS[1], ARGV[1])")(rds, ["k"], "v"),
        ):
            with pytest.raises(TRANSIENT) as caught:
                call()
            refused.append(caught.value)
        for exc in refused:
            assert is_transient(exc), repr(exc)
        assert code in {getattr(e, "status_code", None) for e in refused} | {str(e).split(" ")[0] for e in refused}
    assert rds.set("k", "v")  # and served again once lifted
    rds.close()


@pytest.mark.parametrize("name", ["oom", "misconf"])
def test_a_refused_group_append_is_raised_for_all_not_blamed_on_each_job(own_redis, name):
    """The pump's one script call for many jobs' events: a refusal is an outage it waits out (raised
    for all), not a script error isolated to each job in turn."""
    rds = kv.client(own_redis.url)
    appends = [write.Append(f"j{i}", 1, ['{"seq": 1}'], 60, 1) for i in range(3)]
    with refusing(own_redis, name), pytest.raises(TRANSIENT):
        write.append_many(rds, appends)
    assert all(isinstance(r, list) and len(r) == 1 for r in write.append_many(rds, appends))  # once lifted
    rds.delete(*(keys.stream_key(a.job_id) for a in appends))
    rds.close()


def test_a_reply_error_that_is_a_bug_is_not_transient(own_redis):
    rds = kv.client(own_redis.url)
    rds.rpush("a-list", "x")
    with pytest.raises(redis_lib.ResponseError) as caught:
        rds.get("a-list")  # WRONGTYPE
    assert not is_transient(caught.value) and not isinstance(caught.value, TRANSIENT)
    rds.delete("a-list")
    rds.close()


# -- the API: POST /v1/completions, in process -----------------------------------------------------


def _app(it_settings, own_redis: OwnRedis, principal: Principal) -> tuple[FastAPI, Any]:
    """The API's error handlers, its request-rate gate and its completions routes, wired as api/app.py
    wires them, on this test's Redis. Authentication (api/guard.py, which reads the API's own
    database) is stood in for by setting the principal and the route's cost class it would have found."""
    app = FastAPI()
    errors.install(app)
    app.include_router(completions.router)
    app.add_middleware(RequestRateGate, settings=it_settings)

    engine = create_async_engine(IT_DB)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    rds = kv.async_client(own_redis.url, decode_responses=True)
    app.state.redis = rds
    app.state.hub = app.state.lifecycle = None  # never reached: the request ends at admission
    app.state.fingerprints = render.Fingerprints(it_settings)
    app.state.completions = Completions(
        sessions, rds, it_settings, Idempotency(sessions, lock_s=30.0), Broker(), lambda _m: CharTokenizer()
    )

    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            state = scope.setdefault("state", {})
            state["principal"] = principal  # what api/guard.py sets
            state["cost"] = costs.Declared(costs.Cost.WORK, costs.Body.REQUEST)  # /v1/completions' class
        await app(scope, receive, send)

    async def close() -> None:
        await rds.aclose()
        await engine.dispose()

    return asgi, close


def _post(asgi: Any, close: Any) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=asgi, raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://spool") as client:
                return await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "Hi there", "max_tokens": 4},
                    headers={"prefer": "respond-async"},
                )
        finally:
            await close()

    return asyncio.run(main())


@pytest.fixture
def caller(session, own_redis) -> Principal:
    """A tenant with request and token limits (both rate checks run on Redis), and a live worker."""
    t = factories.tenant(session, tpm=100_000, rpm=1000)
    _, k = factories.api_key(session, t)
    healthy = redis_lib.Redis.from_url(own_redis.url)
    live_workers.beat(healthy, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    healthy.close()
    return Principal(tenant=t, key=k)


def _stored(session, tenant_id: int) -> int:
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id)) or 0


@pytest.mark.parametrize("name", ["oom", "misconf", "readonly", "noreplicas"])
def test_a_refusing_redis_is_a_503_with_retry_after(it_settings, session, own_redis, caller, name):
    with refusing(own_redis, name):
        answer = _post(*_app(it_settings, own_redis, caller))
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["retry-after"]) > 0
    assert answer.json()["error"] == {
        "message": "The service is briefly unavailable; please retry.",
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }
    assert _stored(session, caller.tenant.id) == 0  # nothing stored: the SDK's retry is safe

    # the same request once Redis serves again: stored, and answered 202 (Prefer: respond-async)
    again = _post(*_app(it_settings, own_redis, caller))
    assert again.status_code == 202, again.text
    assert _stored(session, caller.tenant.id) == 1


def test_a_reply_error_that_is_a_bug_stays_a_500(it_settings, session, own_redis, caller):
    admin = own_redis.admin
    tpm = redis_keys.tenant_limit(caller.tenant.id, "tpm")
    admin.rpush(tpm, "not a token bucket")  # the admission script meets WRONGTYPE
    try:
        answer = _post(*_app(it_settings, own_redis, caller))
    finally:
        admin.delete(tpm)
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"]["code"] == "internal_error"
    assert "retry-after" not in answer.headers


# -- a worker: `retrying` waits a refusal out ------------------------------------------------------


@pytest.mark.parametrize("name", ["oom", "misconf", "readonly"])
def test_a_worker_waits_until_redis_takes_writes_again(it_settings, own_redis, name, caplog):
    rds = kv.client(own_redis.url)
    settings = it_settings.model_copy(update={"infra_retry_s": 60.0, "lease_s": 3.0})
    renewals: list[float] = []
    with refusing(own_redis, name) as lift:
        # Redis takes writes again after ~1.5 s (the length of the refusal is the point of this wait)
        timer = threading.Timer(1.5, lift)
        timer.start()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="workers.retry"):
            result = retry.retrying(
                settings, "publish j1", rds.xadd, "job:j1:events", {"seq": 1}, on_wait=lambda: renewals.append(1.0)
            )
        waited = time.monotonic() - started
        timer.join()
    assert result and rds.xlen("job:j1:events") == 1  # written once, after the refusal ended
    assert waited >= 1.0 and renewals  # it paused (keeping its lease), rather than failing
    assert any("infrastructure unavailable" in r.getMessage() for r in caplog.records)
    rds.delete("job:j1:events")
    rds.close()


def test_a_refusal_longer_than_infra_retry_lets_the_attempt_go(it_settings, own_redis):
    """Past `infra_retry_s` the attempt lets go (Abandoned: the job is resumed later), never fails it."""
    rds = kv.client(own_redis.url)
    settings = it_settings.model_copy(update={"infra_retry_s": 0.5})
    with refusing(own_redis, "oom"), pytest.raises(retry.Abandoned) as caught:
        retry.retrying(settings, "publish j2", rds.set, "k", "v")
    assert isinstance(caught.value, retry.LETTING_GO) and is_transient(caught.value.__cause__)
    rds.close()
