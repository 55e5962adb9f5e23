"""`Completions.create`, the use case behind POST /v1/completions, in-process.

Built as api/app.py builds it, but handed a recorder for the broker and a stand-in tokenizer
(one id per character): what is stored is read back from Postgres, what is sent from the
recorder, the reservation from Redis. Postgres and Redis are the integration tests' own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from core.errors import DomainError, ErrorKind
from core.idempotency import Idempotency
from core.infra import redis_keys
from core.infra.broker import Fleet, Outbound
from core.infra.orm import IdempotencyKey, Job
from core.jobs import affinity, live_workers
from core.jobs.service import Completions
from core.protocol.schemas import CompletionRequest
from core.states import JobKind, JobState
from core.tenancy.keys import Principal
from ops import factories
from tests.integration.conftest import IT_DB, IT_REDIS

MODEL = "smollm2-135m-instruct"
T = TypeVar("T")


class CharTokenizer:
    """One token per character; no fill-in-the-middle, no chat template."""

    n_vocab = 100
    train_context = 256
    eos = 0

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        return [10 + ord(c) % 50 for c in text]

    def fim_tokens(self) -> None:
        return None


class Broker:
    """Records every job handed to it, as (job id, attempt, model, kind), and how many went in each
    call (one round trip); `down` makes it fail. `keys`: the affinity key each came with."""

    def __init__(self, down: bool = False) -> None:
        self.sent: list[tuple[str, int, str, str]] = []
        self.keys: list[int | None] = []
        self.calls: list[int] = []
        self.down = down

    async def __call__(self, jobs: Sequence[Outbound], fleets: Mapping[str, Fleet]) -> None:
        if self.down:
            raise ConnectionError("broker unavailable")
        self.sent += [j[:4] for j in jobs]
        self.keys += [j[4] for j in jobs]
        self.calls.append(len(jobs))


def _run(it_settings, broker: Broker, use: Callable[[Completions], Awaitable[T]], roomy: bool = True) -> T:
    async def main() -> T:
        engine = create_async_engine(IT_DB)
        rds = aioredis.Redis.from_url(IT_REDIS, decode_responses=True)
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        keys = Idempotency(sessions, lock_s=30.0)
        service = Completions(sessions, rds, it_settings, keys, broker, lambda _model: CharTokenizer())
        if roomy:
            # Room in flight whatever earlier tests left dispatched: these tests are about storing and
            # sending; when a contended model's requests wait for the dispatcher is test_lifecycle.py's.
            service.submit.capacity = lambda _model: 100_000
        try:
            return await use(service)
        finally:
            await rds.aclose()
            await engine.dispose()

    return asyncio.run(main())


@pytest.fixture(autouse=True)
def uncontended(session) -> None:
    """Each test starts with no request of the model waiting (an earlier test's queued job would make
    every new one wait behind it for the fair dispatcher: core/jobs/transitions.py `_contended`)."""
    session.execute(update(Job).where(Job.model == MODEL, Job.state == JobState.queued.value).values(state="cancelled"))
    session.commit()


@pytest.fixture
def caller(session, rds) -> Principal:
    """A tenant with a token limit (so admission reserves and answers headers), its key, and a live
    worker for the model."""
    t = factories.tenant(session, tpm=100_000)
    _, k = factories.api_key(session, t)
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    return Principal(tenant=t, key=k)


def _request(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi there", "max_tokens": 4, **kw})


def _jobs_of(session, tenant_id: int) -> list[Job]:
    session.expire_all()
    return list(session.scalars(select(Job).where(Job.tenant_id == tenant_id)))


def test_a_request_is_stored_then_sent_once(it_settings, session, rds, caller):
    broker = Broker()
    created = _run(it_settings, broker, lambda s: s.create(caller, _request(user="u1"), request_id="req-1"))

    [row] = _jobs_of(session, caller.tenant.id)
    ids = CharTokenizer().encode("Hi there")
    assert row.id == created.job.id and not created.replayed
    assert (row.state, row.kind, row.model, row.attempt) == (JobState.dispatched, JobKind.interactive, MODEL, 1)
    assert row.prompts == [{"ids": ids, "text": "Hi there"}]  # the stored shape
    assert row.params["max_tokens"] == 4 and row.stream is False
    assert (row.key_id, row.user, row.request_id) == (caller.key.id, "u1", "req-1")
    assert row.reserved_tokens == len(ids) + 4  # the prompt plus the most it may generate
    assert broker.sent == [(row.id, 1, MODEL, "interactive")]  # after the commit, once
    # Its prefix-affinity key (its first prompt tokens, salted with the tenant) is stored and sent.
    assert broker.keys == [row.affinity] == [affinity.from_tokens(caller.tenant.id, ids)]
    assert rds.exists(redis_keys.reservation(row.id))  # its tokens are held until it ends
    assert created.headers["x-ratelimit-limit-tokens"] == "100000"


def test_an_idempotent_retry_gets_the_first_job_and_sends_nothing(it_settings, session, caller):
    broker = Broker()

    async def twice(s: Completions):
        first = await s.create(caller, _request(), idempotency_key="retry-1")
        again = await s.create(caller, _request(), idempotency_key="retry-1")
        return first, again

    first, again = _run(it_settings, broker, twice)
    assert again.replayed and again.job.id == first.job.id
    assert again.headers == {"idempotent-replayed": "true"}
    assert [j.id for j in _jobs_of(session, caller.tenant.id)] == [first.job.id]
    assert broker.sent == [(first.job.id, 1, MODEL, "interactive")]
    key = session.scalar(select(IdempotencyKey).where(IdempotencyKey.tenant_id == caller.tenant.id))
    assert key is not None and key.object_id == first.job.id


def test_a_tenant_at_its_cap_is_stored_queued_and_not_sent(it_settings, session, rds):
    t = factories.tenant(session, max_concurrent=1)
    _, k = factories.api_key(session, t)
    factories.job(session, t, state=JobState.running)  # its one concurrent job
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    broker = Broker()
    created = _run(it_settings, broker, lambda s: s.create(Principal(tenant=t, key=k), _request()))

    assert created.job.state == JobState.queued
    stored = {j.id: j.state for j in _jobs_of(session, t.id)}
    assert stored[created.job.id] == JobState.queued  # the dispatcher sends it when there is room
    assert broker.sent == []


def test_a_failed_send_leaves_the_job_queued_for_the_dispatcher(it_settings, session, caller):
    created = _run(it_settings, Broker(down=True), lambda s: s.create(caller, _request()))

    [row] = _jobs_of(session, caller.tenant.id)
    assert row.id == created.job.id
    assert (row.state, row.dispatched_at) == (JobState.queued, None)  # stored: never a 5xx


def test_a_refused_request_stores_nothing_and_frees_its_key(it_settings, session, rds):
    t = factories.tenant(session, tpm=5)  # less than the prompt alone
    _, k = factories.api_key(session, t)
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    broker = Broker()

    with pytest.raises(DomainError) as err:
        _run(it_settings, broker, lambda s: s.create(Principal(tenant=t, key=k), _request(), idempotency_key="k-429"))
    assert err.value.kind == ErrorKind.rate_limited
    assert _jobs_of(session, t.id) == [] and broker.sent == []
    held = session.scalar(select(func.count()).select_from(IdempotencyKey).where(IdempotencyKey.tenant_id == t.id))
    assert held == 0  # the same retry is refused the same way; a corrected one may reuse the key


def test_a_model_nobody_serves_is_a_503_unless_queued(it_settings, session, rds):
    settings = it_settings.model_copy(update={"models": f"{MODEL},unserved-model"})
    t = factories.tenant(session)
    _, k = factories.api_key(session, t)
    who = Principal(tenant=t, key=k)
    rds.delete(redis_keys.live_workers("unserved-model"))
    broker = Broker()

    with pytest.raises(DomainError) as err:
        _run(settings, broker, lambda s: s.create(who, _request(model="unserved-model")))
    assert err.value.kind == ErrorKind.unavailable and err.value.headers == {"retry-after": "5"}
    assert _jobs_of(session, t.id) == []

    created = _run(
        settings, broker, lambda s: s.create(who, _request(model="unserved-model"), queued=True), roomy=False
    )
    [row] = _jobs_of(session, t.id)
    assert row.id == created.job.id and row.model == "unserved-model"
    # No worker has a slot for it: it waits in Postgres, and the dispatcher sends it once one is live.
    assert row.state == JobState.queued and broker.sent == []


def test_a_live_worker_is_asked_once_a_second_and_its_absence_every_time(it_settings, session, rds, caller):
    """The API asks Redis whether a worker serves the model at most once a second while one does; once
    none does, every request asks again (a worker that comes back is seen at once)."""
    monkey = {"now": 1000.0}

    async def use(s: Completions) -> list[bool]:
        import core.jobs.service as service

        real_clock = service.time.monotonic
        service.time.monotonic = lambda: monkey["now"]  # type: ignore[assignment]
        try:
            seen = [await s._live(MODEL)]  # asks: a worker beats (the fixture)
            rds.delete(redis_keys.live_workers(MODEL))
            seen.append(await s._live(MODEL))  # within the second: the yes is kept
            monkey["now"] += service.LIVE_CACHE_S + 0.01
            seen.append(await s._live(MODEL))  # asked again: no worker now
            live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
            seen.append(await s._live(MODEL))  # a no is not kept: back at once
            return seen
        finally:
            service.time.monotonic = real_clock  # type: ignore[assignment]

    assert _run(it_settings, Broker(), use) == [True, True, False, True]


def test_a_small_request_is_prepared_on_the_loop_once_its_tokenizer_is_loaded(it_settings, session, caller):
    import threading

    threads_seen: list[int] = []

    def tokenizer(_model: str) -> CharTokenizer:
        threads_seen.append(threading.get_ident())
        return CharTokenizer()

    async def use(s: Completions) -> int:
        s.tokenizers = tokenizer
        await s.create(caller, _request(), small=True)  # first: on a thread (it may load the tokenizer)
        await s.create(caller, _request(), small=True)  # then on the loop
        await s.create(caller, _request(), small=False)  # a big body: on a thread
        await s.create(caller, _request(regex="[ab]+"), small=True)  # a grammar to build: on a thread
        return threading.get_ident()

    loop_thread = _run(it_settings, Broker(), use)
    assert [t == loop_thread for t in threads_seen] == [False, True, False, False]


def _burst(it_settings, broker: Broker, bodies: list[tuple[Principal, CompletionRequest]]) -> tuple[list[Any], int]:
    """Every create at once (a burst), through one service: (each outcome, job or exception, in
    order; how many INSERTs of jobs reached Postgres)."""
    from sqlalchemy import event

    inserts = 0

    def count(_conn, _cursor, statement: str, *_args: Any) -> None:
        nonlocal inserts
        inserts += statement.lstrip().upper().startswith("INSERT INTO JOBS")

    async def use(s: Completions) -> list[Any]:
        event.listen(s.submit.sessions.kw["bind"].sync_engine, "before_cursor_execute", count)
        await s.create(*bodies[0])  # the model's tokenizer loaded: the burst stays on the loop, as in production
        burst = (s.create(who, body, small=True) for who, body in bodies[1:])
        outcomes = await asyncio.gather(*burst, return_exceptions=True)
        return [None, *outcomes]

    outcomes = _run(it_settings, broker, use)
    return outcomes, inserts - 1


def test_a_burst_is_stored_in_few_statements_and_each_job_sent_once(it_settings, session, caller):
    broker = Broker()
    n = 24
    outcomes, inserts = _burst(it_settings, broker, [(caller, _request(user=f"u{i}")) for i in range(n + 1)])

    created = [o.job for o in outcomes[1:]]
    rows = {j.id: j for j in _jobs_of(session, caller.tenant.id)}
    assert len(rows) == n + 1 and all(rows[j.id].state == JobState.dispatched for j in created)
    assert [rows[j.id].user for j in created] == [f"u{i}" for i in range(1, n + 1)]  # each row is its own request's
    assert sorted(broker.sent) == sorted((j, 1, MODEL, "interactive") for j in rows)  # each sent once
    # Grouped: the burst's jobs went in fewer INSERTs and fewer pushes than one per job.
    assert inserts < n and len(broker.calls) - 1 < n, f"{inserts} INSERTs, pushes of {broker.calls}"


def test_a_burst_keeps_the_tenants_concurrency_cap(it_settings, session, rds):
    """Jobs of one tenant stored by one statement do not see each other: each counts those ahead of it."""
    t = factories.tenant(session, max_concurrent=3)
    _, k = factories.api_key(session, t)
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    who = Principal(tenant=t, key=k)
    broker = Broker()
    _burst(it_settings, broker, [(who, _request()) for _ in range(9)])

    states = [r.state for r in _jobs_of(session, t.id)]
    assert states.count(JobState.dispatched) == 3 and states.count(JobState.queued) == 6
    assert len(broker.sent) == 3  # the dispatcher sends the rest as the cap allows


def test_one_unstorable_request_in_a_burst_fails_alone(it_settings, session, caller):
    """A value Postgres refuses fails the group's statement: the group is retried job by job, so only
    that request fails (a 400 in the API: api/errors.py) and the others are stored and sent."""
    from sqlalchemy.exc import DataError

    broker = Broker()
    bodies = [(caller, _request(user="bad\x00user" if i == 5 else f"u{i}")) for i in range(12)]
    outcomes, _ = _burst(it_settings, broker, bodies)

    assert isinstance(outcomes[5], DataError)
    good = [o.job.id for i, o in enumerate(outcomes) if i not in (0, 5)]
    rows = {j.id: j for j in _jobs_of(session, caller.tenant.id)}
    assert len(rows) == 11 and set(good) <= set(rows)
    assert sorted(j for j, *_ in broker.sent) == sorted(rows)


def test_a_tenant_over_its_quota_is_refused_before_its_grammar_is_compiled(it_settings, session, rds, monkeypatch):
    """The constraint's size is checked while the request is prepared; its compile (llguidance: up to
    seconds for a big one) waits until the tenant's limits have taken the request."""
    from core.jobs import service as service_module

    compiled: list[object] = []
    monkeypatch.setattr(service_module, "compile_constraint", lambda *a: compiled.append(a) or "never")
    t = factories.tenant(session, tpm=5)  # less than the prompt alone
    _, k = factories.api_key(session, t)
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    body = _request(guided_choice=[f"choice number {i}" for i in range(1_500)])
    with pytest.raises(DomainError) as err:
        _run(it_settings, Broker(), lambda s: s.create(Principal(tenant=t, key=k), body, None))
    assert err.value.kind == ErrorKind.rate_limited
    assert compiled == [] and _jobs_of(session, t.id) == []
    # The same request from a tenant with room is compiled, once (the stand-in above is what is used).
    roomy = factories.tenant(session, tpm=100_000)
    _, k2 = factories.api_key(session, roomy)
    _run(it_settings, Broker(), lambda s: s.create(Principal(tenant=roomy, key=k2), body, None))
    assert len(compiled) == 1 and len(_jobs_of(session, roomy.id)) == 1


class CountingTokenizer(CharTokenizer):
    """CharTokenizer that counts the characters it is asked to encode: the work a request cost."""

    def __init__(self) -> None:
        self.chars = 0

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        self.chars += len(text)
        return super().encode(text, add_special=add_special)


def test_a_tenant_out_of_tokens_is_refused_before_its_prompt_is_counted(it_settings, session, rds):
    """Issue 49: prompts were tokenized before admission, so a tenant past its tokens per minute still
    made the API count every prompt it sent. Now a request whose floor (its characters / 64) cannot be
    admitted is a 429 before any tokenizing; the tenant's next request within its limit is counted."""
    t = factories.tenant(session, tpm=100)
    _, k = factories.api_key(session, t)
    live_workers.beat(rds, MODEL, "it-worker", batch_slots=4, interactive_slots=4)
    who = Principal(tenant=t, key=k)
    tok = CountingTokenizer()

    async def use(service: Completions) -> tuple[DomainError, DomainError]:
        service.tokenizers = lambda _model: tok
        first = CompletionRequest(model=MODEL, prompt="x" * 90, max_tokens=5)
        await service.create(who, first)  # 95 of its 100 tokens a minute reserved
        counted = tok.chars
        over = CompletionRequest(model=MODEL, prompt="y" * 6_400, max_tokens=1)  # a floor of 100 tokens
        with pytest.raises(DomainError) as refused:
            await service.create(who, over)
        huge = CompletionRequest(model=MODEL, prompt="y" * 600_000, max_tokens=1)  # past the limit at all
        with pytest.raises(DomainError) as never:
            await service.create(who, huge)
        assert "more than the limit allows at all" in never.value.message
        assert tok.chars == counted  # both refused with nothing tokenized
        small = CompletionRequest(model=MODEL, prompt="z" * 20, max_tokens=1)
        with pytest.raises(DomainError) as counted_then_refused:
            await service.create(who, small)  # its floor (1) fits: counted, then refused by admission
        assert tok.chars == counted + 20
        return refused.value, counted_then_refused.value

    before, after = _run(it_settings, Broker(), use)
    for e in (before, after):
        assert e.kind is ErrorKind.rate_limited and e.code == "rate_limit_exceeded"
        assert "tokens per minute" in e.message.lower() or "TPM" in e.message
    assert int(before.headers["retry-after"]) >= 1
