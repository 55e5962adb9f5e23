"""Issue 49: a job's marks (where each stream entry left off) live on its row, not in Redis. Once an
ended job's stream has expired (5 minutes), a resume from any event id it gave is still placed
exactly in the row's text, for as long as the row exists: `GET /v1/jobs/{id}/events` with a
`Last-Event-ID`, and a Responses rejoin with `starting_after`. When the marks lived in Redis, with
the stream, such a resume was refused as `resume_expired` (and a rejoin gave the whole text as one
delta, numbered unlike the live stream's). The expiry is simulated by deleting the job's keys.

Real Postgres and Redis; jobs streamed and ended by `Lifecycle` as a worker does; read over HTTP from
the in-process API of tests/integration/test_downloads.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.generation.events import ChoiceResult, Delta, JobResult, Usage
from core.infra.orm import Job, Tenant
from core.infra.streams import keys, read, write
from core.jobs.lifecycle import Lifecycle
from core.protocol import render
from core.states import JobState
from ops import factories
from tests.integration.test_downloads import Server, api_server, tenant_key  # noqa: F401

# Multi-byte characters: the marks count characters as Python does, not bytes.
WORDS = [" héllo", " wörld", " 日本", " 🎉!", " plain", " and", " a", " tail."]
MIDDLE = 3  # resume after the third entry


@pytest.fixture
def client(api_server: Server, sessions: sessionmaker[Session]) -> Iterator[tuple[int, httpx.Client]]:  # noqa: F811
    tid, key = tenant_key(sessions)
    with httpx.Client(base_url=api_server.base, headers={"authorization": f"Bearer {key}"}, timeout=60) as http:
        yield tid, http


def _streamed_and_ended(lc: Lifecycle, sessions: sessionmaker[Session], tenant_id: int, **kw: Any) -> Job:
    """A job as a worker runs it: claimed (its fence raised), one delta per word by the fenced
    append, then `succeed`."""
    with sessions() as s:
        j = factories.job(s, s.get_one(Tenant, tenant_id), state=JobState.running, lease_s=60, **kw)
    write.raise_fence(lc.redis, j.id, 1, lc.settings.events_ttl_s)
    last = len(WORDS) - 1
    deltas = [
        Delta(attempt=1, choice=0, text=w, token_ids=[i], finish_reason="stop" if i == last else None)
        for i, w in enumerate(WORDS)
    ]
    lc.publish_deltas(j.id, 1, deltas, start=1)
    result = JobResult(choices=[ChoiceResult(index=0, text="".join(WORDS), finish_reason="stop")])
    assert lc.succeed(j, result, Usage(prompt_tokens=3, completion_tokens=len(WORDS)), 0.01)
    return j


def _expire(rds: Any, job_id: str) -> None:
    """What `ended_events_ttl_s` does to an ended job's keys (and did to its marks in Redis)."""
    held = (keys.stream_key(job_id), keys.marks_key(job_id), keys.fence_key(job_id))
    rds.delete(*held)
    # Nothing else of it there to place a resume (a cancel's flag stays its hour, and is no place).
    assert {k.decode() for k in rds.scan_iter(match=f"*{job_id}*", count=1000)} <= {keys.cancel_key(job_id)}


def _sse(http: httpx.Client, path: str, **kw: Any) -> list[tuple[str | None, str]]:
    """(id, data) of each event of an SSE answer."""
    out: list[tuple[str | None, str]] = []
    event_id: str | None = None
    with http.stream("GET", path, **kw) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                out.append((event_id, line[6:]))
                event_id = None
    return out


def _resumed(http: httpx.Client, job_id: str, last_id: str) -> tuple[str, list[dict[str, Any]]]:
    """The text a client resuming after `last_id` gets, and every chunk it got."""
    chunks = [
        json.loads(d)
        for _, d in _sse(http, f"/v1/jobs/{job_id}/events", headers={"last-event-id": last_id})
        if d != "[DONE]"
    ]
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    return text, chunks


def test_a_jobs_events_resume_exactly_from_the_middle_after_its_stream_expired(
    client: tuple[int, httpx.Client], sessions: sessionmaker[Session], rds: Any, it_settings: Any
) -> None:
    tid, http = client
    lc = Lifecycle(sessions, rds, it_settings)
    j = _streamed_and_ended(lc, sessions, tid)
    after = "".join(WORDS[MIDDLE:])
    middle = f"0-{MIDDLE}"  # the id the client was given with the third delta

    live, _ = _resumed(http, j.id, middle)
    assert live == after  # while the stream is there: read from it
    with sessions() as s:
        kept = s.get_one(Job, j.id).marks
    assert [m[2] for m in read.parse_marks(kept)] == [len(w) for w in WORDS]

    _expire(rds, j.id)
    text, chunks = _resumed(http, j.id, middle)
    errors = [c["error"] for c in chunks if "error" in c]
    assert errors == [], errors  # the old code: `resume_expired`
    assert text == after  # neither repeated nor skipped
    assert [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")][-1] == "stop"
    for k in range(len(WORDS)):  # every place it gave, not only the middle
        assert _resumed(http, j.id, f"0-{k}")[0] == "".join(WORDS[k:]), k


def _rejoin(http: httpx.Client, rid: str, after: int) -> list[dict[str, Any]]:
    path = f"/v1/responses/{rid}"
    return [json.loads(d) for _, d in _sse(http, path, params={"stream": "true", "starting_after": after})]


def _shape(events: list[dict[str, Any]]) -> list[tuple[str, int, str | None]]:
    return [(e["type"], e["sequence_number"], e.get("delta")) for e in events]


def test_a_response_rejoin_after_its_stream_expired_numbers_its_deltas_as_the_live_one(
    client: tuple[int, httpx.Client], sessions: sessionmaker[Session], rds: Any, it_settings: Any
) -> None:
    tid, http = client
    lc = Lifecycle(sessions, rds, it_settings)
    meta = {"input": [{"type": "message", "role": "user", "content": "Say it."}], "store": True, "background": True}
    j = _streamed_and_ended(lc, sessions, tid, chat={"response": meta})
    rid = render.response_id(j.id)

    whole = _rejoin(http, rid, -1)  # from the start, while the stream is there
    deltas = [e for e in whole if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in deltas] == WORDS  # one event per stream entry
    after = deltas[MIDDLE - 1]["sequence_number"]  # the client saw the third delta, then lost the connection
    live = _rejoin(http, rid, after)
    assert "".join(e.get("delta", "") for e in live) == "".join(WORDS[MIDDLE:])

    _expire(rds, j.id)
    rebuilt = _rejoin(http, rid, after)
    # The old code cut the row's text as nothing (no marks): one delta numbered where the first was,
    # so a rejoin after the third got none of the text.
    assert _shape(rebuilt) == _shape(live)
    assert rebuilt[-1]["type"] == "response.completed"
    assert rebuilt[-1]["response"]["output"][0]["content"][0]["text"] == "".join(WORDS)


def _streamed(lc: Lifecycle, sessions: sessionmaker[Session], tenant_id: int, attempt: int, **kw: Any) -> Job:
    """A running job (at `attempt`) that has streamed every word but the last, not yet ended."""
    with sessions() as s:
        j = factories.job(s, s.get_one(Tenant, tenant_id), state=JobState.running, attempt=attempt, **kw)
    write.raise_fence(lc.redis, j.id, attempt, lc.settings.events_ttl_s)
    deltas = [Delta(attempt=attempt, choice=0, text=w, token_ids=[i]) for i, w in enumerate(WORDS[:-1])]
    lc.publish_deltas(j.id, attempt, deltas, start=1)
    return j


@pytest.mark.parametrize("how", ["cancel", "reap"])
def test_every_ending_that_streamed_keeps_its_marks_on_its_row(
    client: tuple[int, httpx.Client], sessions: sessionmaker[Session], rds: Any, it_settings: Any, how: str
) -> None:
    """The API's cancel and the reaper's failing of a job whose last worker was lost end it in a
    transaction of their own (not the worker's one statement): the row keeps the marks all the same."""
    tid, http = client
    lc = Lifecycle(sessions, rds, it_settings)
    if how == "cancel":
        j = _streamed(lc, sessions, tid, 1, lease_s=60)
        assert lc.cancel(j.id, tid) is not None
    else:
        last = it_settings.max_attempts
        j = _streamed(lc, sessions, tid, last, lease_s=-5)  # its lease lapsed on its last attempt
        assert lc.reap()["failed"] >= 1
    with sessions() as s:
        row = s.get_one(Job, j.id)
        assert row.state == ("cancelled" if how == "cancel" else "failed")
        assert [m[2] for m in read.parse_marks(row.marks)] == [len(w) for w in WORDS[:-1]]

    _expire(rds, j.id)
    text, chunks = _resumed(http, j.id, f"0-{MIDDLE}")
    # Placed, so answered with the job's ending alone (the old code: `resume_expired`).
    assert text == "" and [c["error"]["code"] for c in chunks] == ["cancelled" if how == "cancel" else "worker_lost"], (
        chunks
    )
