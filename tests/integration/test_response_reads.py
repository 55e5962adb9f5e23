"""Responses are read as jobs are (issue 49): `GET /v1/responses/{id}`, `/cancel`, `/input_items` and
the rejoin's events built and encoded on the prepare threads inside the tenant's gate; the rejoin
tests that the stream is there from its first entry, never by reading it whole; a deleted or unstored
response is a 404 through the job routes too. Driven over HTTP against the in-process API of
tests/integration/test_downloads.py; the responses are rows as the API leaves them (`ops/factories`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.sse import HEAVY
from core.infra.orm import Job, Tenant
from core.infra.streams import read
from core.protocol import render
from core.protocol import responses as wire
from core.states import JobState
from ops import factories
from tests.integration.test_downloads import Server, api_server, tenant_key  # noqa: F401

BIG = "You are terse. " * 20_000  # 300 KB of instructions: a client-sized object


@dataclass
class Api:
    server: Server
    tenant_id: int
    http: httpx.Client


@pytest.fixture
def api(api_server: Server, sessions: sessionmaker[Session]) -> Iterator[Api]:  # noqa: F811
    tid, key = tenant_key(sessions)
    with httpx.Client(base_url=api_server.base, headers={"authorization": f"Bearer {key}"}, timeout=60) as http:
        yield Api(api_server, tid, http)


def _threads_of(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """A spy on `owner.name`: records the thread of each call, then runs it as ever."""
    seen: list[int] = []
    real = getattr(owner, name)

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, spy)
    return seen


def _response(sessions: sessionmaker[Session], tenant_id: int, **meta: Any) -> str:
    """A succeeded, stored response (its stream long gone from Redis), with `meta` over its settings."""
    base = {
        "instructions": BIG,
        "input": [{"type": "message", "role": "user", "content": "Capital of France?"}],
        "store": True,
        "background": False,
    }
    with sessions() as s:
        t = s.get(Tenant, tenant_id)
        j = factories.job(s, t, state=JobState.succeeded, chat={"response": {**base, **meta}})
        j.result = {"choices": [{"index": 0, "text": "Paris.", "finish_reason": "stop"}]}
        j.usage = {"prompt_tokens": 5, "completion_tokens": 2}
        s.commit()
        return render.response_id(j.id)


def test_a_response_is_retrieved_cancelled_and_listed_off_the_loop_in_its_tenants_gate(
    api: Api, sessions: sessionmaker[Session], monkeypatch
):
    built = _threads_of(monkeypatch, render, "response_of")
    listed = _threads_of(monkeypatch, wire, "input_item_list")
    rid = _response(sessions, api.tenant_id)

    got = api.http.get(f"/v1/responses/{rid}")
    assert got.status_code == 200, got.text
    body = got.json()
    assert (body["id"], body["status"], body["instructions"]) == (rid, "completed", BIG)
    assert body["output"][0]["content"][0]["text"] == "Paris."
    ended = api.http.post(f"/v1/responses/{rid}/cancel")  # an ended response is answered as it is
    assert ended.status_code == 200 and ended.json()["status"] == "completed"
    items = api.http.get(f"/v1/responses/{rid}/input_items")
    assert items.status_code == 200 and items.json()["data"][0]["content"][0]["text"] == "Capital of France?"

    assert len(built) == 2 and api.server.loop_thread not in built, built
    assert len(listed) == 1 and api.server.loop_thread not in listed
    assert HEAVY.most.get(api.tenant_id) == 1  # each inside the tenant's gate


def test_a_rejoin_tests_the_stream_from_its_first_entry_and_builds_off_the_loop(
    api: Api, sessions: sessionmaker[Session], monkeypatch
):
    whole = _threads_of(monkeypatch, read.Hub, "entries_upto")  # XRANGE - + : the stream read whole
    firsts: list[int] = []
    real_page = read.Hub.page

    async def page(self: read.Hub, job_id: str, after: str, count: int) -> list[tuple[str, str]]:
        firsts.append(count)  # a spy: the sizes asked for, then the real read
        return await real_page(self, job_id, after, count)

    monkeypatch.setattr(read.Hub, "page", page)
    started = _threads_of(monkeypatch, wire.Events, "start")
    rid = _response(sessions, api.tenant_id)

    events = []
    with api.http.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Paris."
    assert events[0]["response"]["instructions"] == BIG

    assert whole == [] and firsts == [1]  # its existence read one entry at most
    assert len(started) == 1 and api.server.loop_thread not in started
    assert HEAVY.most.get(api.tenant_id) == 1


@pytest.mark.parametrize("how", ["deleted", "store_false"])
def test_a_forgotten_response_is_unknown_to_the_job_routes(api: Api, sessions: sessionmaker[Session], how: str):
    kept = _response(sessions, api.tenant_id)
    if how == "deleted":
        rid = _response(sessions, api.tenant_id)
        assert api.http.delete(f"/v1/responses/{rid}").status_code == 200
    else:
        rid = _response(sessions, api.tenant_id, store=False, input=[])
    job_id = "cmpl-" + rid.removeprefix("resp_")

    for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
        got = api.http.request(method, f"/v1/jobs/{job_id}{path}")
        assert got.status_code == 404, (method, path, got.text)
        assert got.json()["error"]["code"] == "job_not_found" and got.json()["error"]["param"] == "job_id"
        other = api.http.request(method, f"/v1/jobs/cmpl-{kept.removeprefix('resp_')}{path}")
        assert other.status_code == 200, (method, path, other.text)  # a stored one still reads
    assert api.http.get(f"/v1/responses/{rid}").status_code == 404
    with sessions() as s:
        assert s.get(Job, job_id) is not None  # the job stays (its usage, its place in the ledger)


def test_a_responses_row_is_read_off_the_loop_for_every_read(api: Api, sessions: sessionmaker[Session], monkeypatch):
    """The row itself (its megabytes of input and instructions, decoded by the driver) is loaded on a
    prepare thread, never on the event loop: 50 readers of a 6 MiB response held the loop 8 s and grew
    the API by 685 MiB when each GET loaded it there (ops/hostile.py responses_large_object_reads)."""
    from core.jobs.responses import Responses

    loads = _threads_of(monkeypatch, Responses, "load")
    rid = _response(sessions, api.tenant_id)
    assert api.http.get(f"/v1/responses/{rid}").status_code == 200
    assert api.http.get(f"/v1/responses/{rid}/input_items").status_code == 200
    assert api.http.post(f"/v1/responses/{rid}/cancel").status_code == 200
    with api.http.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as r:
        assert r.status_code == 200
        r.read()
    # GET, input_items and the rejoin load it; the cancel's row comes from the cancel itself, on a thread too
    assert len(loads) == 3 and api.server.loop_thread not in loads
