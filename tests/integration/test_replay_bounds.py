"""Issue 35 (no tenant can hold the others hostage), replays: the readers of a job are counted in a
way that cannot go negative when a lease lapses, a replay's backlog is coalesced in one pass (its
tokens, token ids and logprobs joined once) into one exact chunk, and a large job object built off
the loop is the same JSON the declared model gives. Real Redis and Postgres; no speed is asserted
(the numbers are in the report of the change and `ops/bench`)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace

from api import sse
from api.bodies import encode as encode_body
from api.routes import jobs as job_routes
from core.generation.events import Delta, TokenScore, TopToken, encode
from core.generation.params import GenerationParams
from core.infra import kv, redis_keys
from core.infra.streams import keys, read, write
from core.jobs.follow import coalesce
from core.protocol import render
from core.protocol.render import CompletionChunks
from core.protocol.schemas import JobObject
from core.states import JobState
from ops import factories
from tests.integration.conftest import IT_REDIS


async def _unstored(_job_id: str, _tenant_id: int) -> None:
    """The job row a silent stream asks for: these jobs are not in the database."""
    return None


def _record(job_id: str, **params) -> SimpleNamespace:
    return SimpleNamespace(
        id=job_id,
        model="m",
        state="running",
        attempt=1,
        params=GenerationParams(max_tokens=100_000, **params).to_json(),
        chat=None,
        result=None,
        usage=None,
        error=None,
        created_at=datetime.now(UTC),
        started_at=None,
        finished_at=None,
    )


def test_a_lapsed_reader_lease_never_leaves_a_negative_count(rds):
    """The counter had a TTL: under a stream longer than it, it lapsed, the stream's end took it to
    -1, the next reader counted 0 while it followed (its job cancellable from under it) and -1 after
    it left, and -1 reads as "someone follows": no disconnect cancelled the job ever again."""
    job_id = "readers-lapse"
    rds.delete(keys.stream_key(job_id), redis_keys.readers(job_id))
    write.raise_fence(rds, job_id, 1, 60)
    write.append_fenced(rds, job_id, 1, [encode(Delta(attempt=1, choice=0, text=" a", token_ids=[1]))], 60, 1)

    async def scenario() -> None:
        arc = kv.async_client(IT_REDIS)
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=200)

        async def count_is(n: int) -> None:
            for _ in range(100):  # a reader is uncounted by a task of its own: give it its turn
                if await sse.readers(arc, job_id) == n:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"readers {await sse.readers(arc, job_id)}, expected {n}")

        def reader():
            return sse.sse_chunks(
                _record(job_id), 1, arc, hub, lookup=_unstored, include_usage=False, fingerprint="fp", heavy_cap=8
            )

        try:
            first = reader()
            assert b" a" in await anext(first)
            await count_is(1)
            rds.delete(redis_keys.readers(job_id))  # what the lapsed TTL did under a long stream
            await first.aclose()
            await count_is(0)
            second = reader()
            await anext(second)
            await count_is(1)  # the old counter said 0 here: the job could be cancelled from under it
            await second.aclose()
            await count_is(0)  # and -1 here: read as a reader, nothing cancelled on disconnect again
        finally:
            await hub.aclose()

    asyncio.run(scenario())


def test_a_replay_of_an_ended_job_is_not_counted_as_a_reader(rds):
    """Readers are counted so that a live job is not cancelled under someone who follows it. An
    ended job has nothing to cancel: 200 replays of one cost 400 Redis round trips for nothing."""
    job_id = "readers-ended"
    rds.delete(keys.stream_key(job_id), redis_keys.readers(job_id))
    write.raise_fence(rds, job_id, 1, 60)
    write.append_fenced(rds, job_id, 1, [encode(Delta(attempt=1, choice=0, text=" a", token_ids=[1]))], 60, 1)
    ended = _record(job_id)
    ended.state = JobState.succeeded.value

    async def scenario() -> None:
        arc = kv.async_client(IT_REDIS)
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=200)
        try:
            live = sse.sse_chunks(
                _record(job_id), 1, arc, hub, lookup=_unstored, include_usage=False, fingerprint="fp", heavy_cap=8
            )
            assert b" a" in await anext(live)
            assert await sse.readers(arc, job_id) == 1  # the same stream, followed while live, counts
            await live.aclose()
            for _ in range(100):  # uncounted by a task of its own
                if await sse.readers(arc, job_id) == 0:
                    break
                await asyncio.sleep(0.02)
            replay = sse.sse_chunks(
                ended, 1, arc, hub, lookup=_unstored, include_usage=False, fingerprint="fp", heavy_cap=8
            )
            assert b" a" in await anext(replay)
            await asyncio.sleep(0.1)  # a count in flight would have landed
            assert await sse.readers(arc, job_id) == 0
            await replay.aclose()
        finally:
            await hub.aclose()

    asyncio.run(scenario())


def _scored_deltas(n: int) -> list[tuple[str | None, Delta]]:
    return [
        (
            f"0-{i + 1}",
            Delta(
                attempt=1,
                choice=0,
                text=f" w{i}",
                token_ids=[i],
                scores=[
                    TokenScore(
                        id=i,
                        text=f" w{i}",
                        logprob=-0.25,
                        offset=0,
                        top=[TopToken(id=j, text=f"x{j}", logprob=-1.0) for j in range(3)],
                    )
                ],
            ),
        )
        for i in range(n)
    ]


def test_a_backlog_of_16k_scored_deltas_is_one_exact_chunk_under_its_last_id(rds):
    batch = _scored_deltas(16_000)
    ((last_id, merged),) = coalesce(batch)  # type: ignore[arg-type]
    assert last_id == "0-16000"
    assert isinstance(merged, Delta)
    assert merged.text == "".join(f" w{i}" for i in range(16_000))
    assert merged.token_ids == list(range(16_000))
    assert [s.id for s in merged.scores or []] == list(range(16_000))
    body = sse.frame(CompletionChunks(_record("j16k", logprobs=3), False, "fp"), batch)  # type: ignore[arg-type]
    events = [block for block in body.decode().split("\n\n") if block]
    assert len(events) == 1
    fields = dict(line.split(": ", 1) for line in events[0].split("\n"))
    assert fields["id"] == "0-16000"
    chunk = json.loads(fields["data"])
    assert chunk["choices"][0]["text"] == merged.text
    assert chunk["choices"][0]["logprobs"]["tokens"] == [f" w{i}" for i in range(16_000)]


def test_a_large_job_object_built_off_the_loop_is_the_declared_models_json(session):
    tenant = factories.tenant(session)
    scores = [TokenScore(id=i, text=f" t{i}", logprob=-0.5, offset=3 * i).model_dump() for i in range(5000)]
    text = "".join(f" t{i}" for i in range(5000))
    row = factories.job(session, tenant, state=JobState.succeeded, params=GenerationParams(max_tokens=5000, logprobs=0))
    row.result = {"choices": [{"index": 0, "text": text, "finish_reason": "length", "scores": scores}]}
    row.usage, row.finished_at = {"prompt_tokens": 1, "completion_tokens": 5000}, datetime.now(UTC)
    session.commit()
    assert job_routes._large(row)
    built = json.loads(encode_body(job_routes._job_body(row, "fp")))  # as api/costs.build encodes it
    expected = JobObject.model_validate(render.job(row, "fp")).model_dump(mode="json", by_alias=True)
    assert built == expected
    assert built["result"]["choices"][0]["text"] == text
    assert len(built["result"]["choices"][0]["logprobs"]["tokens"]) == 5000


def test_one_tenants_heavy_replays_take_turns_and_never_hold_another_tenants(rds, monkeypatch):
    """Twelve replays of one big backlog from tenant 1 with a cap of 3: at most three are framed at
    once, each still gets the whole backlog; tenant 2's replay is framed while tenant 1's three places
    are all held (its builds are blocked on a gate the test opens only after tenant 2 is done)."""
    job_id = "heavy-turns"
    rds.delete(keys.stream_key(job_id))
    write.raise_fence(rds, job_id, 1, 60)
    deltas = [encode(d) for _, d in _scored_deltas(400)]
    write.append_fenced(rds, job_id, 1, deltas, 60, 1)
    gate = sse.TenantGate()
    monkeypatch.setattr(sse, "HEAVY", gate)
    real_frame = sse.frame
    release = asyncio.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []

    def frame(chunks, batch):  # tenant 1's builds wait until tenant 2's replay has been framed
        if chunks_tenant.get(id(chunks)) == 1:
            asyncio.run_coroutine_threadsafe(release.wait(), loop_box[0]).result(30)
        return real_frame(chunks, batch)

    chunks_tenant: dict[int, int] = {}
    real_chunks_for = sse.chunks_for

    async def scenario() -> None:
        loop_box.append(asyncio.get_running_loop())
        arc = kv.async_client(IT_REDIS)
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=200)

        async def replay(tenant: int) -> bytes:
            def chunks_for(*a, **k):
                c = real_chunks_for(*a, **k)
                chunks_tenant[id(c)] = tenant
                return c

            monkeypatch.setattr(sse, "chunks_for", chunks_for)
            gen = sse.sse_chunks(
                _record(job_id, logprobs=3),
                tenant,
                arc,
                hub,
                lookup=_unstored,
                include_usage=False,
                fingerprint="fp",
                heavy_cap=3,
            )
            return await anext(gen)

        try:
            crowd = [asyncio.create_task(replay(1)) for _ in range(12)]
            for _ in range(200):
                if gate.busy.get(1) == 3:
                    break
                await asyncio.sleep(0.01)
            assert gate.busy.get(1) == 3  # the cap is full, the other nine wait their turn
            alone = await asyncio.wait_for(replay(2), 30)  # not behind tenant 1's places
            assert b" w399" in alone
            release.set()
            bodies = await asyncio.gather(*crowd)
            assert all(b == bodies[0] and b" w399" in b for b in bodies)
            assert gate.most[1] == 3
        finally:
            await hub.aclose()

    monkeypatch.setattr(sse, "frame", frame)
    asyncio.run(scenario())


def test_a_replay_waiting_for_its_turn_holds_nothing_of_its_last_page(rds, monkeypatch):
    """200 replays of one long job took the API to +700 MiB: each one, waiting for its tenant's gate
    before its next page, still held the last page it had been given (decoded events and framed
    bytes). Now, between pages, none of its decoded events are alive."""
    import gc

    from core.jobs import follow as job_follow

    job_id = "replay-holds-nothing"
    rds.delete(keys.stream_key(job_id))
    write.raise_fence(rds, job_id, 1, 60)
    write.append_fenced(rds, job_id, 1, [encode(d) for _, d in _scored_deltas(400)], 60, 1)
    monkeypatch.setattr(job_follow, "PAGE", 100)
    gate = sse.TenantGate()
    monkeypatch.setattr(sse, "HEAVY", gate)

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, (Delta, TokenScore)) for o in gc.get_objects())

    async def scenario() -> None:
        arc = kv.async_client(IT_REDIS)
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=200)
        before = alive()
        gen = sse.sse_chunks(
            _record(job_id, logprobs=3),
            1,
            arc,
            hub,
            lookup=_unstored,
            include_usage=False,
            fingerprint="fp",
            heavy_cap=1,
        )
        try:
            first = await anext(gen)  # the first page, framed: the replay holds the tenant's one place
            assert b" w0" in first and b" w99" in first and b" w100" not in first
            assert alive() - before >= 200  # its 100 deltas and their scores, inside the gate
            taken, release = asyncio.Event(), asyncio.Event()

            async def other_replay() -> None:  # the tenant's next build, queued for the place
                async with gate.hold(1, 1):
                    taken.set()
                    await release.wait()

            holder = asyncio.create_task(other_replay())
            await asyncio.sleep(0)
            nxt = asyncio.create_task(anext(gen))  # gives its place up, then waits for it again
            await asyncio.wait_for(taken.wait(), 10)
            await asyncio.sleep(0.05)
            assert not nxt.done()
            assert alive() - before == 0  # waiting: nothing of the first page is held
            release.set()
            second = await asyncio.wait_for(nxt, 10)
            assert b" w100" in second and b" w199" in second
            await holder
        finally:
            await gen.aclose()
            await hub.aclose()
            await arc.aclose()

    asyncio.run(scenario())
