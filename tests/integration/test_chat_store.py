"""Stored chat completions (`store: true`, issue 51): a chat request that asks to be stored keeps its
messages and metadata on its job, and once it succeeds it is retrieved, listed (cursor, order,
metadata and model filters), its metadata updated, its messages listed and it is deleted, through
OpenAI's routes; only the tenant's own, stored, succeeded completions are seen, everything else is
the same 404. Driven over HTTP against the in-process API of tests/integration/test_downloads.py;
completions are rows as the API and a worker leave them (`ops/factories`), or created by the API."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.infra.orm import Job, Tenant
from core.states import JobState
from ops import factories
from tests.integration.test_downloads import Server, api_server, tenant_key  # noqa: F401

MODEL = "smollm2-135m-instruct"
_n = itertools.count()


@dataclass
class Api:
    tenant_id: int
    http: httpx.Client


def _client(server: Server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base, headers={"authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture
def api(api_server: Server, sessions: sessionmaker[Session]) -> Iterator[Api]:  # noqa: F811
    tid, key = tenant_key(sessions)
    with _client(api_server, key) as http:
        yield Api(tid, http)


@pytest.fixture
def other(api_server: Server, sessions: sessionmaker[Session]) -> Iterator[Api]:  # noqa: F811
    tid, key = tenant_key(sessions)
    with _client(api_server, key) as http:
        yield Api(tid, http)


def _stored(
    sessions: sessionmaker[Session],
    tenant_id: int,
    *,
    state: JobState = JobState.succeeded,
    metadata: dict[str, str] | None = None,
    messages: list[dict[str, Any]] | None = None,
    store: bool = True,
    model: str = MODEL,
) -> str:
    """A chat job as the API stores it (with `store: true`, what it keeps) and, when `state` is
    succeeded, as its worker ends it."""
    chat: dict[str, Any] = {"tools": False, "top_logprobs": None}
    if store:
        asked = messages or [{"role": "user", "content": f"Question {next(_n)}?"}]
        chat["stored"] = {"messages": asked, "metadata": metadata or {}}
    with sessions() as s:
        t = s.get(Tenant, tenant_id)
        assert t is not None
        j = factories.job(s, t, state=state, chat=chat, model=model)
        if state == JobState.succeeded:
            j.result = {"choices": [{"index": 0, "text": "Paris.", "finish_reason": "stop"}]}
            j.usage = {"prompt_tokens": 5, "completion_tokens": 2}
            s.commit()
        return j.id


def _ids(page: dict[str, Any]) -> list[str]:
    return [c["id"] for c in page["data"]]


def test_a_chat_request_with_store_keeps_its_messages_and_metadata_and_is_served_once_it_succeeds(
    api: Api, sessions: sessionmaker[Session]
):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Capital"}, {"type": "text", "text": "of France?"}]},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "store": True, "metadata": {"topic": "geo"}}
    queued = {"prefer": "respond-async"}  # no worker runs here: the job stays queued until we end it
    made = api.http.post("/v1/chat/completions", json=body, headers=queued)
    assert made.status_code == 202, made.text
    job_id = made.json()["id"]
    omitted = {k: v for k, v in body.items() if k != "store"}
    plain = api.http.post("/v1/chat/completions", json=omitted, headers=queued)
    unstored = api.http.post("/v1/chat/completions", json={**body, "store": False}, headers=queued)
    with sessions() as s:
        chats = {i: s.get(Job, i).chat for i in (job_id, plain.json()["id"], unstored.json()["id"])}  # type: ignore[union-attr]
    assert chats[job_id]["stored"] == {"messages": messages, "metadata": {"topic": "geo"}}
    assert "stored" not in chats[plain.json()["id"]] and "stored" not in chats[unstored.json()["id"]]

    # Queued: not a stored completion yet (OpenAI shows one once it is made), and not listed.
    assert api.http.get(f"/v1/chat/completions/{job_id}").status_code == 404
    assert api.http.get(f"/v1/chat/completions/{job_id}/messages").status_code == 404
    assert _ids(api.http.get("/v1/chat/completions").json()) == []

    with sessions() as s:  # its worker ends it
        s.execute(
            text(
                "UPDATE jobs SET state = 'succeeded', finished_at = now(), result = CAST(:r AS json), "
                "usage = CAST(:u AS jsonb) WHERE id = :id"
            ),
            {
                "id": job_id,
                "r": '{"choices": [{"index": 0, "text": "Paris.", "finish_reason": "stop"}]}',
                "u": '{"prompt_tokens": 20, "completion_tokens": 2}',
            },
        )
        s.commit()
    got = api.http.get(f"/v1/chat/completions/{job_id}")
    assert got.status_code == 200, got.text
    answered = api.http.get(f"/v1/jobs/{job_id}").json()["result"]  # the completion as its create answers it
    assert got.json() == {**answered, "metadata": {"topic": "geo"}}
    assert got.json()["choices"][0]["message"]["content"] == "Paris."
    assert _ids(api.http.get("/v1/chat/completions").json()) == [job_id]
    items = api.http.get(f"/v1/chat/completions/{job_id}/messages").json()["data"]
    assert items == [
        {"id": f"{job_id}-0", "role": "system", "content": "You are terse.", "name": None, "content_parts": None},
        {
            "id": f"{job_id}-1",
            "role": "user",
            "content": "Capital\nof France?",  # joined as the prompt joined them
            "name": None,
            "content_parts": messages[1]["content"],
        },
    ]


def test_only_the_tenants_stored_succeeded_completions_are_listed_in_order_with_filters_and_cursor(
    api: Api, other: Api, sessions: sessionmaker[Session]
):
    a = _stored(sessions, api.tenant_id, metadata={"topic": "geo", "run": "1"})
    b = _stored(sessions, api.tenant_id, metadata={"topic": "math"})
    c = _stored(sessions, api.tenant_id, metadata={"topic": "geo"}, model="another-model")
    _stored(sessions, api.tenant_id, store=False)
    _stored(sessions, api.tenant_id, state=JobState.running, metadata={"topic": "geo"})
    _stored(sessions, api.tenant_id, state=JobState.failed, metadata={"topic": "geo"})
    theirs = _stored(sessions, other.tenant_id, metadata={"topic": "geo"})

    listed = api.http.get("/v1/chat/completions").json()
    assert listed["object"] == "list" and _ids(listed) == [a, b, c] and listed["has_more"] is False
    assert (listed["first_id"], listed["last_id"]) == (a, c)
    assert listed["data"][0]["metadata"] == {"topic": "geo", "run": "1"}
    assert _ids(api.http.get("/v1/chat/completions", params={"order": "desc"}).json()) == [c, b, a]
    first = api.http.get("/v1/chat/completions", params={"limit": 2}).json()
    assert _ids(first) == [a, b] and first["has_more"] is True
    rest = api.http.get("/v1/chat/completions", params={"limit": 2, "after": b}).json()
    assert _ids(rest) == [c] and rest["has_more"] is False
    back = api.http.get("/v1/chat/completions", params={"order": "desc", "after": c}).json()
    assert _ids(back) == [b, a]

    geo = api.http.get("/v1/chat/completions", params={"metadata[topic]": "geo"}).json()
    assert _ids(geo) == [a, c]
    both = {"metadata[topic]": "geo", "metadata[run]": "1"}
    assert _ids(api.http.get("/v1/chat/completions", params=both).json()) == [a]
    assert _ids(api.http.get("/v1/chat/completions", params={"model": MODEL}).json()) == [a, b]
    assert _ids(other.http.get("/v1/chat/completions").json()) == [theirs]

    bad = api.http.get("/v1/chat/completions", params={"metadata[" + "k" * 65 + "]": "v"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata"
    foreign = api.http.get("/v1/chat/completions", params={"after": theirs})  # no cursor of another tenant's
    assert foreign.status_code == 400 and foreign.json()["error"]["param"] == "after"
    assert api.http.get("/v1/chat/completions", params={"limit": 101}).status_code == 400
    assert api.http.get("/v1/chat/completions", params={"metadata[topic]": "a\x00b"}).status_code == 400  # not a 500


def test_another_tenants_unstored_unfinished_and_unknown_ids_are_the_same_404(
    api: Api, other: Api, sessions: sessionmaker[Session]
):
    theirs = _stored(sessions, other.tenant_id)
    unstored = _stored(sessions, api.tenant_id, store=False)
    running = _stored(sessions, api.tenant_id, state=JobState.running)
    unknown = "cmpl-" + "0" * 24

    def answer(method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        r = api.http.request(method, path, **kw)
        body = r.json()
        body["error"]["message"] = body["error"]["message"].replace(path.split("/")[4], "ID")
        return r.status_code, body

    for job_id in (theirs, unstored, running, unknown):
        for method, path, kw in (
            ("GET", f"/v1/chat/completions/{job_id}", {}),
            ("GET", f"/v1/chat/completions/{job_id}/messages", {}),
            ("POST", f"/v1/chat/completions/{job_id}", {"json": {"metadata": {"k": "v"}}}),
            ("DELETE", f"/v1/chat/completions/{job_id}", {}),
        ):
            status, body = answer(method, path, **kw)
            assert status == 404, (job_id, method, path, body)
            assert body == answer(method, path.replace(job_id, unknown), **kw)[1]  # nothing tells them apart
    assert other.http.get(f"/v1/chat/completions/{theirs}").status_code == 200  # untouched by the attempts
    with sessions() as s:
        kept = s.get(Job, theirs)
        assert kept is not None and kept.chat is not None and kept.chat["stored"]["metadata"] == {}


def test_metadata_is_updated_and_a_deleted_completion_is_gone_from_every_route(
    api: Api, sessions: sessionmaker[Session]
):
    asked = [{"role": "user", "content": f"Message {n}"} for n in range(5)]
    job_id = _stored(sessions, api.tenant_id, metadata={"topic": "geo"}, messages=asked)

    updated = api.http.post(f"/v1/chat/completions/{job_id}", json={"metadata": {"topic": "math", "v": "2"}})
    assert updated.status_code == 200, updated.text
    assert updated.json()["metadata"] == {"topic": "math", "v": "2"} and updated.json()["id"] == job_id
    assert api.http.get(f"/v1/chat/completions/{job_id}").json()["metadata"] == {"topic": "math", "v": "2"}
    assert _ids(api.http.get("/v1/chat/completions", params={"metadata[topic]": "geo"}).json()) == []
    too_many = {f"k{n}": "v" for n in range(17)}
    refused = api.http.post(f"/v1/chat/completions/{job_id}", json={"metadata": too_many})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"
    extra = api.http.post(f"/v1/chat/completions/{job_id}", json={"metadata": {}, "model": "x"})
    assert extra.status_code == 400
    nul = api.http.post(f"/v1/chat/completions/{job_id}", json={"metadata": {"topic": "a\x00b"}})
    assert nul.status_code == 400  # a value Postgres cannot store: the client's, never a 500
    cleared = api.http.post(f"/v1/chat/completions/{job_id}", json={"metadata": None})
    assert cleared.status_code == 200 and cleared.json()["metadata"] == {}

    first = api.http.get(f"/v1/chat/completions/{job_id}/messages", params={"limit": 2}).json()
    assert [m["content"] for m in first["data"]] == ["Message 0", "Message 1"] and first["has_more"] is True
    after = api.http.get(f"/v1/chat/completions/{job_id}/messages", params={"after": first["last_id"]}).json()
    assert [m["content"] for m in after["data"]] == ["Message 2", "Message 3", "Message 4"]
    newest = api.http.get(f"/v1/chat/completions/{job_id}/messages", params={"order": "desc", "limit": 1}).json()
    assert newest["data"][0]["id"] == f"{job_id}-4"

    with sessions() as s:
        before = s.get(Job, job_id)
        assert before is not None
        bytes_before = before.stored_bytes
    deleted = api.http.delete(f"/v1/chat/completions/{job_id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": job_id, "object": "chat.completion.deleted", "deleted": True}
    assert api.http.get(f"/v1/chat/completions/{job_id}").status_code == 404
    assert api.http.get(f"/v1/chat/completions/{job_id}/messages").status_code == 404
    assert api.http.post(f"/v1/chat/completions/{job_id}", json={"metadata": {}}).status_code == 404
    assert api.http.delete(f"/v1/chat/completions/{job_id}").status_code == 404
    assert _ids(api.http.get("/v1/chat/completions").json()) == []
    assert api.http.get(f"/v1/jobs/{job_id}").status_code == 404  # deleted, not only unlisted
    with sessions() as s:
        after_row = s.get(Job, job_id)
        assert after_row is not None and after_row.chat is not None and "stored" not in after_row.chat
        assert after_row.stored_bytes < bytes_before  # its kept messages no longer count to the tenant
