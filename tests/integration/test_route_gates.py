"""Every route takes its class's per-minute limit before any work (api/costs.py, api/request_gate.py;
issue 49): the sweep walks the application's own route table, so a route added tomorrow is swept
too. A tenant whose requests and reads per minute are spent gets OpenAI's 429 from each of them,
before its body is read, a row is looked up or an object built, while another tenant is served.

The API runs in-process (starlette's TestClient, lifespan included) on this session's integration
database and Redis db."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from api import costs
from ops import factories
from tests.integration.conftest import IT_DB, IT_REDIS, spool_env


@pytest.fixture(scope="module")
def client(sessions: sessionmaker[Session], rds) -> Iterator[TestClient]:  # rds: the db flushed
    env = {
        "SPOOL_DATABASE_URL": IT_DB,
        "SPOOL_REDIS_URL": IT_REDIS,
        "SPOOL_READS_PER_MINUTE": "2",
        "SPOOL_LOG_FORMAT": "text",
    }
    with spool_env(env):
        from api.app import create_app

        with TestClient(create_app(), raise_server_exceptions=False) as c:
            yield c


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _charged_routes(client: TestClient) -> list[tuple[str, str, costs.Declared]]:
    out = []
    for route in costs.routes(client.app):
        d = costs.declared(route.endpoint)
        assert d is not None and route.path is not None, route
        if d.cost is costs.Cost.PUBLIC:
            continue
        path = re.sub(r"\{[^}]+\}", "x1", route.path)
        for method in sorted(route.methods or ()):
            out.append((method, path, d))
    return out


def test_every_charged_route_refuses_a_spent_tenant_before_any_work(client: TestClient, sessions):
    with sessions() as s:
        spent = factories.tenant(s, rpm=1)
        key, _ = factories.api_key(s, spent)
        other = factories.tenant(s)
        other_key, _ = factories.api_key(s, other)
    # The tenant spends its one request and its two reads a minute.
    assert client.post("/tokenize", json={"content": "hi"}, headers=_auth(key)).status_code == 200
    for _ in range(2):
        assert client.get("/v1/models", headers=_auth(key)).status_code == 200

    routes = _charged_routes(client)
    assert len(routes) > 30  # the whole table, not a hand-picked list
    huge = b'{"prompt": "' + b"x" * (6 << 20) + b'"}'  # the largest legal body: refused unread
    for method, path, d in routes:
        body = huge if d.cost is costs.Cost.WORK and d.body is costs.Body.REQUEST else b"{}"
        r = client.request(method, path, content=body, headers={**_auth(key), "Content-Type": "application/json"})
        assert r.status_code == 429, (method, path, r.status_code, r.text[:200])
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded"
        want = "requests per minute (RPM)" if d.rate == "requests" else "reads per minute"
        assert want in err["message"], (method, path, err)
        assert int(r.headers["retry-after"]) >= 1

    # Another tenant is served meanwhile: the limits are the spent tenant's own.
    assert client.get("/v1/models", headers=_auth(other_key)).status_code == 200


def test_a_read_is_refused_before_the_row_is_read(client: TestClient, sessions):
    """A spent reader's GET of a job is a 429, not the job: the gate ran before the handler."""
    with sessions() as s:
        t = factories.tenant(s)
        key, _ = factories.api_key(s, t)
        job = factories.job(s, t)
    for _ in range(2):
        assert client.get(f"/v1/jobs/{job.id}", headers=_auth(key)).status_code == 200
    r = client.get(f"/v1/jobs/{job.id}", headers=_auth(key))
    assert r.status_code == 429 and "id" not in r.json()


def test_a_small_class_refuses_a_large_body_before_reading_it(client: TestClient, sessions):
    """A route of class `cheap` or `sized` takes 64 KiB at most (a cancel carries no work)."""
    with sessions() as s:
        t = factories.tenant(s)
        key, _ = factories.api_key(s, t)
    r = client.post("/v1/jobs/x1/cancel", content=b"x" * (costs.SMALL_BODY + 1), headers=_auth(key))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
