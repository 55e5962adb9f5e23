"""The API's shared stream reader (core/infra/streams/read.Hub) against a real Redis: every follower gets
exactly the entries after its own position, once, whenever it joins."""

from __future__ import annotations

import asyncio

from core.infra import kv
from core.infra.streams import keys, read, write
from tests.integration.conftest import IT_REDIS

# The shared read blocks far longer than a follower waits for news: a follower that joined while it
# was blocked and was not woken would time out (None) instead of receiving its entries.
HUB_BLOCK_MS = 30_000
FOLLOWER_WAIT_MS = 3_000


async def _take(it, n: int) -> list:
    return [await anext(it) for _ in range(n)]


def _append(rds, job_id: str, *payloads: str) -> list[str]:
    pipe = rds.pipeline(transaction=False)
    write.queue_append(pipe, job_id, payloads, 60)
    return [i.decode() for i in pipe.execute()[:-1]]


def test_followers_of_one_hub_each_get_their_own_entries_once(rds):
    async def scenario() -> None:
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=HUB_BLOCK_MS)
        try:
            a_ids = _append(rds, "hub-a", "a1", "a2")
            from_start = hub.read("hub-a", "0-0", FOLLOWER_WAIT_MS)
            assert await _take(from_start, 2) == list(zip(a_ids, ["a1", "a2"], strict=True))

            # The hub is now blocked on hub-a alone; a second job's follower joins and is served.
            b_ids = _append(rds, "hub-b", "b1")
            other_job = hub.read("hub-b", "0-0", FOLLOWER_WAIT_MS)
            assert await _take(other_job, 1) == [(b_ids[0], "b1")]

            # A re-attaching reader of hub-a (Last-Event-ID = its first entry) gets only what follows,
            # while the first reader, already past it, gets only news.
            reattached = hub.read("hub-a", a_ids[0], FOLLOWER_WAIT_MS)
            assert await _take(reattached, 1) == [(a_ids[1], "a2")]
            more = _append(rds, "hub-a", "a3")
            assert await _take(from_start, 1) == [(more[0], "a3")]
            assert await _take(reattached, 1) == [(more[0], "a3")]

            # An entry that is not Spool's (no payload field) is skipped, not fatal to the shared read.
            rds.xadd(keys.stream_key("hub-b"), {"other": "x"})
            after = _append(rds, "hub-b", "b2")
            assert await _take(other_job, 1) == [(after[0], "b2")]

            # Silence is reported as None (the caller then asks Postgres), not as an end.
            quiet = hub.read("hub-c", "0-0", 200)
            assert await anext(quiet) is None

            for it in (from_start, other_job, reattached, quiet):
                await it.aclose()
            assert hub._followers == {}  # a closed follower leaves nothing behind
        finally:
            await hub.aclose()
            await hub.redis.aclose()

    asyncio.run(scenario())


def test_a_bad_resume_id_fails_its_follower_alone(rds):
    """Ids that str.isdigit() accepts but Redis refuses (past 64 bits, '²', Arabic-Indic digits) used
    to reach the one shared XREAD and break it for every stream of the process."""

    async def scenario() -> None:
        hub = read.Hub(
            kv.async_client(IT_REDIS, decode_responses=True), block_ms=2000
        )  # short: closing waits out a blocked read
        try:
            steady = hub.read("hub-steady", "0-0", FOLLOWER_WAIT_MS)
            first = _append(rds, "hub-steady", "s0")
            assert await _take(steady, 1) == [(first[0], "s0")]
            for bad in (
                "99999999999999999999-0",
                "18446744073709551616",
                "²",
                "\u0661\u0662\u0663-\u0660",
                "1-2-3",
                "",
                " 1",
            ):
                poisoned = hub.read("hub-steady", bad, FOLLOWER_WAIT_MS)
                try:
                    await anext(poisoned)
                    raise AssertionError(f"{bad!r} was accepted")
                except read.InvalidStreamId:
                    pass
                # The steady follower still gets each entry as it is written, one read each.
                ids = _append(rds, "hub-steady", f"after {bad}")
                assert await _take(steady, 1) == [(ids[0], f"after {bad}")]

            # A stream Redis refuses for another reason (its key is not a stream) fails its own
            # followers, and the others keep reading.
            rds.set(keys.stream_key("hub-wrongtype"), "x")
            wrong = hub.read("hub-wrongtype", "0-0", FOLLOWER_WAIT_MS)
            try:
                await anext(wrong)
                raise AssertionError("a follower of a non-stream key got an entry")
            except Exception as exc:
                assert "WRONGTYPE" in str(exc)
            ids = _append(rds, "hub-steady", "last")
            assert await _take(steady, 1) == [(ids[0], "last")]
            await steady.aclose()
        finally:
            rds.delete(keys.stream_key("hub-wrongtype"))
            await hub.aclose()
            await hub.redis.aclose()

    asyncio.run(scenario())


def test_parse_id_takes_only_what_redis_takes():
    assert read.parse_id("0") == "0-0"
    assert read.parse_id("1700000000000-5") == "1700000000000-5"
    assert read.parse_id("18446744073709551615-18446744073709551615") == "18446744073709551615-18446744073709551615"
    for bad in ("18446744073709551616-0", "1-18446744073709551616", "²", "\u0661", "1-", "-1", "1\n", "+1", "1" * 21):
        assert read.parse_id(bad) is None, bad


def test_a_follower_fed_steadily_hears_no_silence_and_a_quiet_one_hears_it_each_period(rds):
    """Silence (None) is told by one timer per follower, re-armed from the last entry put: news more
    often than `block_ms` never yields None; a quiet follower gets None once per `block_ms`."""

    async def scenario() -> None:
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=2000)
        try:
            busy = hub.read("hub-busy", "0-0", 300)
            quiet = hub.read("hub-quiet", "0-0", 300)
            got: list = []
            for i in range(8):  # 8 x 100 ms: well past the 300 ms of silence a None would need
                ids = _append(rds, "hub-busy", f"t{i}")
                got += await _take(busy, 1)
                assert got[-1] == (ids[0], f"t{i}")
                await asyncio.sleep(0.1)
            assert None not in got
            loop = asyncio.get_running_loop()
            began = loop.time()
            assert await anext(quiet) is None  # joined ~0.8 s ago: a None has been waiting
            assert await anext(quiet) is None
            assert 0.2 <= loop.time() - began <= 1.5  # the next one a period later, not at once
            await busy.aclose()
            await quiet.aclose()
            assert hub._followers == {}
        finally:
            await hub.aclose()
            await hub.redis.aclose()

    asyncio.run(scenario())


def test_followers_joining_during_one_blocked_read_share_one_wake(rds):
    """Each follower that joins while the shared read is blocked used to send its own wake (an XADD
    and an EXPIRE per new stream: one per short job). One wake per blocked read serves them all."""

    async def scenario() -> None:
        hub = read.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=HUB_BLOCK_MS)
        try:
            first = hub.read("hub-w0", "0-0", FOLLOWER_WAIT_MS)
            ids = _append(rds, "hub-w0", "x")
            assert await _take(first, 1) == [(ids[0], "x")]  # the shared read now blocks on hub-w0
            joiners = [hub.read(f"hub-w{i}", "0-0", FOLLOWER_WAIT_MS) for i in range(1, 17)]
            pending = [asyncio.ensure_future(anext(j)) for j in joiners]  # all join before any wake returns
            await asyncio.sleep(0.3)
            info = rds.xinfo_stream(hub._wake_key)
            added = int(info.get("entries-added", info.get(b"entries-added", 0)))
            assert added == 1, f"{added} wakes for 16 followers joining one blocked read"
            for i in range(1, 17):
                _append(rds, f"hub-w{i}", f"y{i}")
            got = await asyncio.gather(*pending)
            assert [p for _, p in got] == [f"y{i}" for i in range(1, 17)]  # every joiner is served
            for it in (first, *joiners):
                await it.aclose()
        finally:
            await hub.aclose()
            await hub.redis.aclose()

    asyncio.run(scenario())


class _JoinsDuringRead:
    """The hub's real Redis client; once armed, `joined()` runs when a shared XREAD has its answer and
    before the hub hands it out: a follower joining at that moment (a race seen in CI with 1,000
    readers on one API process, 2026-11-28: some readers' text lacked the job's first entry)."""

    def __init__(self, real) -> None:
        self.real, self.joined = real, None

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def xread(self, *args, **kw):
        resp = await self.real.xread(*args, **kw)
        if self.joined is not None and any("hub-late" in str(k) for k, _ in resp or []):
            joined, self.joined = self.joined, None
            await joined()
        return resp


def test_a_follower_joining_while_a_read_is_answered_misses_nothing(rds):
    async def scenario() -> None:
        client = _JoinsDuringRead(kv.async_client(IT_REDIS, decode_responses=True))
        hub = read.Hub(client, block_ms=HUB_BLOCK_MS)
        late = hub.read("hub-late", "0-0", FOLLOWER_WAIT_MS)
        first_of_late: list[asyncio.Task] = []
        try:
            early = hub.read("hub-late", "0-0", FOLLOWER_WAIT_MS)
            e1 = _append(rds, "hub-late", "e1")
            assert await _take(early, 1) == [(e1[0], "e1")]

            async def join() -> None:  # the late reader registers from the stream's start
                first_of_late.append(asyncio.ensure_future(anext(late)))
                await asyncio.sleep(0)

            client.joined = join
            e2 = _append(rds, "hub-late", "e2")  # the shared read (from e1) answers with e2 alone
            assert await _take(early, 1) == [(e2[0], "e2")]
            # Before, the late reader was handed that answer and skipped e1 for good.
            assert await first_of_late[0] == (e1[0], "e1")
            assert await _take(late, 1) == [(e2[0], "e2")]
            for it in (early, late):
                await it.aclose()
        finally:
            await hub.aclose()
            await client.real.aclose()

    rds.delete(keys.stream_key("hub-late"))
    asyncio.run(scenario())
