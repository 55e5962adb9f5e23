"""The API's shared stream reader (core/infra/streams.Hub) against a real Redis: every follower gets
exactly the entries after its own position, once, whenever it joins."""

from __future__ import annotations

import asyncio

from core.infra import kv, streams
from tests.integration.conftest import IT_REDIS

# The shared read blocks far longer than a follower waits for news: a follower that joined while it
# was blocked and was not woken would time out (None) instead of receiving its entries.
HUB_BLOCK_MS = 30_000
FOLLOWER_WAIT_MS = 3_000


async def _take(it, n: int) -> list:
    return [await anext(it) for _ in range(n)]


def _append(rds, job_id: str, *payloads: str) -> list[str]:
    pipe = rds.pipeline(transaction=False)
    streams.queue_append(pipe, job_id, payloads, 60)
    return [i.decode() for i in pipe.execute()[:-1]]


def test_followers_of_one_hub_each_get_their_own_entries_once(rds):
    async def scenario() -> None:
        hub = streams.Hub(kv.async_client(IT_REDIS, decode_responses=True), block_ms=HUB_BLOCK_MS)
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
            rds.xadd(streams.stream_key("hub-b"), {"other": "x"})
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
