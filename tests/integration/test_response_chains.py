"""A `previous_response_id` chain is bounded from one row, admitted before it is expanded, and
expanded off the event loop (issue 49): `Responses.create_response` in-process, on the integration
tests' own Postgres and Redis, built as api/app.py builds it but handed a recorder for the broker and a
stand-in tokenizer with a chat template (it records the text it tokenizes and the thread it ran on).
The chains are response rows written as the API leaves them (`ops/factories`); the chain columns are
the migration's trigger's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from sqlalchemy import event
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from core.config import Settings
from core.errors import DomainError, ErrorKind
from core.idempotency import Idempotency
from core.infra.orm import Job
from core.jobs import live_workers
from core.jobs.responses import Responses
from core.jobs.service import Created
from core.protocol import render
from core.protocol import responses as wire
from core.protocol.responses import ResponsesRequest
from core.states import JobState
from core.tenancy import limits
from core.tenancy.keys import Principal
from ops import factories
from tests.integration.conftest import IT_DB, IT_REDIS
from tests.integration.test_create_completion import Broker, CharTokenizer

MODEL = "smollm2-135m-instruct"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
T = TypeVar("T")


class ChatTokenizer(CharTokenizer):
    """One token per character, a chat template; records what it tokenized, on which thread."""

    train_context = 1 << 20

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.threads: list[int] = []

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        self.texts.append(text)
        self.threads.append(threading.get_ident())
        return super().encode(text, add_special=add_special)

    def chat_template(self) -> str:
        return TEMPLATE

    def special_text(self) -> tuple[str, str]:
        return "", ""


class Run:
    """What one run of the service did: the SQL statements it sent, the tokenizer, the loop's thread."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.tok = ChatTokenizer()
        self.loop_thread = 0


def _run(settings: Settings, use: Callable[[Responses], Awaitable[T]]) -> tuple[T | DomainError, Run]:
    run = Run()

    async def main() -> T | DomainError:
        run.loop_thread = threading.get_ident()
        engine = create_async_engine(IT_DB)
        event.listen(engine.sync_engine, "before_cursor_execute", lambda *a: run.statements.append(a[2]))
        rds = aioredis.Redis.from_url(IT_REDIS, decode_responses=True)
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        service = Responses(sessions, rds, settings, Idempotency(sessions, lock_s=30.0), Broker(), lambda _m: run.tok)
        try:
            return await use(service)
        except DomainError as exc:
            return exc
        finally:
            await rds.aclose()
            await engine.dispose()

    return asyncio.run(main()), run


@pytest.fixture
def caller(session, rds) -> Principal:
    t = factories.tenant(session)
    _, k = factories.api_key(session, t)
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    return Principal(tenant=t, key=k)


def _stored(session, tenant, text: str, prev: str | None = None, answer: str | None = None) -> str:
    """A stored response as the API leaves it; without `answer`, cancelled while queued (billed 0)."""
    meta = {"input": [{"type": "message", "role": "user", "content": text}], "previous_response_id": prev}
    state = JobState.succeeded if answer is not None else JobState.cancelled
    j = factories.job(session, tenant, state=state, chat={"response": {**meta, "store": True, "background": False}})
    if answer is not None:
        j.result = {"choices": [{"index": 0, "text": answer, "finish_reason": "stop"}]}
        session.commit()
    return render.response_id(j.id)


def _chain(session, tenant, n: int, size: int = 8) -> list[str]:
    ids: list[str] = []
    for i in range(n):
        ids.append(
            _stored(session, tenant, f"link{i}:" + "x" * size, ids[-1] if ids else None, "Paris" if i == 1 else None)
        )
    return ids


def _next(prev: str, text: str = "and then?") -> ResponsesRequest:
    return ResponsesRequest.model_validate(
        {"model": MODEL, "input": text, "previous_response_id": prev, "max_output_tokens": 4}
    )


def _row(session, resp_id: str) -> Job:
    session.expire_all()
    job = session.get(Job, wire.job_id_of(resp_id))
    assert job is not None
    return job


def _chain_reads(run: Run) -> list[str]:
    """Statements that read a link's stored input or output (the head's size columns are not)."""
    return [s for s in run.statements if "RECURSIVE" in s or ("jobs.chat" in s and "jobs.result" in s)]


def test_each_response_row_carries_its_chains_size(session, caller):
    ids = _chain(session, caller.tenant, 3, size=100_000)
    rows = [_row(session, i) for i in ids]
    own = [r.chain_bytes - (rows[n - 1].chain_bytes if n else 0) for n, r in enumerate(rows)]
    assert [r.chain_links for r in rows] == [1, 2, 3]
    # Each link counts its stored input, the ones cancelled while queued (billed nothing) too.
    assert all(100_000 < b < 100_100 for b in own), own
    assert rows[0].state == JobState.cancelled and rows[0].usage is None
    plain = factories.job(session, caller.tenant)  # not a response
    assert (plain.chain_links, plain.chain_bytes) == (0, 0)


@pytest.mark.parametrize("bound", ["links", "bytes"])
def test_a_chain_over_its_bounds_is_refused_from_the_previous_row_alone(it_settings, session, caller, bound):
    if bound == "links":
        settings = it_settings.model_copy(update={"responses_chain_max_links": 2})
        head = _chain(session, caller.tenant, 3)[-1]
    else:  # one link, cancelled while queued: it still costs its chain what it stores
        settings = it_settings.model_copy(update={"responses_chain_max_bytes": 32 * 1024})
        head = _stored(session, caller.tenant, "y" * 64 * 1024)
    got, run = _run(settings, lambda s: s.create_response(caller, _next(head), small=True))

    assert isinstance(got, DomainError) and got.kind == ErrorKind.invalid, got
    assert got.param == "previous_response_id" and "chain of previous responses" in got.message
    assert ("more than 2" if bound == "links" else "more than 32768") in got.message
    assert len(run.statements) == 1 and not _chain_reads(run), run.statements  # the head's size, nothing else
    assert run.tok.texts == []


@pytest.mark.parametrize("limit", ["rpm", "max_queued"])
def test_the_tenants_limits_take_the_request_before_its_chain_is_expanded(it_settings, session, rds, caller, limit):
    t = caller.tenant
    setattr(t, limit, 1)
    session.commit()
    head = _chain(session, t, 3)[-1]
    if limit == "rpm":
        taken = limits.take_request  # the minute's one request, taken as the edge takes it

        async def first() -> limits.Decision:
            aio = aioredis.Redis.from_url(IT_REDIS)
            try:
                return await taken(aio, t.id, caller.key.id, 1, 0)
            finally:
                await aio.aclose()

        assert asyncio.run(first()).allowed
    else:  # one unfinished job holds the tenant's only place
        assert limits.admit_many(rds, [(t.id, caller.key.id, "cmpl-live", limits.Limits(max_queued=1), 1)])[0].allowed
    got, run = _run(it_settings, lambda s: s.create_response(caller, _next(head), small=True))

    assert isinstance(got, DomainError) and got.kind == ErrorKind.rate_limited, got
    assert ("requests per minute" if limit == "rpm" else "unfinished jobs") in got.message
    assert not _chain_reads(run), run.statements  # refused with no link of the chain read
    assert run.tok.texts == []


def test_a_chain_is_expanded_and_tokenized_off_the_loop_in_one_statement(it_settings, session, caller):
    ids = _chain(session, caller.tenant, 3)

    async def warm_then_chain(s: Responses) -> Created:
        # A small body of a warm model is tokenized on the loop; a small body with a chain must not be.
        await s.create_response(caller, ResponsesRequest.model_validate({"model": MODEL, "input": "hi"}), small=True)
        return await s.create_response(caller, _next(ids[-1], "fourth"), small=True)

    got, run = _run(it_settings, warm_then_chain)

    assert not isinstance(got, DomainError), got
    # The conversation, oldest first: each link's input, and the answer of the one that succeeded.
    [(prompt, thread)] = [(x, t) for x, t in zip(run.tok.texts, run.tok.threads, strict=True) if "fourth" in x]
    at = [prompt.index(w) for w in ("<user>link0:", "<user>link1:", "<assistant>Paris", "<user>link2:", "<user>fourth")]
    assert at == sorted(at), prompt
    assert thread != run.loop_thread  # templated and tokenized off the loop
    assert len([s for s in run.statements if "RECURSIVE" in s]) == 1  # the chain read at once, not row by row
    row = _row(session, render.response_id(got.job.id))
    assert (row.chain_links, row.chain_bytes) == (
        4,
        _row(session, ids[-1]).chain_bytes + len('[{"role": "user", "type": "message", "content": "fourth"}]'),
    )


def test_the_expansion_runs_off_the_loop(it_settings, session, caller, monkeypatch):
    seen: list[int] = []
    real = wire.chain_messages

    def spy(job: Any) -> list[dict[str, Any]]:  # a spy: records the thread, then renders as ever
        seen.append(threading.get_ident())
        return real(job)

    monkeypatch.setattr(wire, "chain_messages", spy)
    head = _chain(session, caller.tenant, 3)[-1]
    got, run = _run(it_settings, lambda s: s.create_response(caller, _next(head), small=True))
    assert not isinstance(got, DomainError), got
    assert len(seen) == 3 and run.loop_thread not in seen
