"""core/infra/kv.Lua: scripts go by their digest, and a Redis that forgot them (a restart, SCRIPT
FLUSH) gets the text again, for the sync and the asyncio client alike (admission runs on both)."""

from __future__ import annotations

import asyncio
import time

from core.infra import kv
from core.tenancy import limits
from tests.integration.conftest import IT_REDIS

ECHO = kv.Lua("return {KEYS[1], ARGV[1]}")


# On a redis-server of its own: it counts EVAL calls in INFO commandstats, which are the whole
# server's, so another shard's scripts on the shared Redis moved the count (a fresh-clone run,
# 2026-11-28), and its SCRIPT FLUSH would be theirs too.
def test_a_script_runs_by_digest_and_is_loaded_again_after_a_flush():
    import redis

    from ops.bench.paced import private_redis

    with private_redis() as (url, _pid), redis.Redis.from_url(url) as rds:
        _script_by_digest(rds)


def _script_by_digest(rds) -> None:
    rds.script_flush()
    assert rds.script_exists(ECHO.sha) == [False]
    assert ECHO(rds, ["k"], "v") == [b"k", b"v"]  # NOSCRIPT, then EVAL: cached again
    assert rds.script_exists(ECHO.sha) == [True]
    before = rds.info("commandstats").get("cmdstat_eval", {}).get("calls", 0)
    assert ECHO(rds, ["k2"], "v2") == [b"k2", b"v2"]
    assert rds.info("commandstats").get("cmdstat_eval", {}).get("calls", 0) == before  # EVALSHA alone


def test_admission_after_redis_forgot_its_scripts(rds):
    rds.script_flush()
    caps = limits.Limits(rpm=5, tpm=0, tpd=0, max_queued=0, key_rpm=0, key_tpm=0)
    job = f"lua-{time.time_ns()}"

    async def main():
        client = kv.async_client(IT_REDIS)
        try:
            taken = await limits.take_request(client, 987654, 1, 5, 0)
            admitted = await limits.admit(client, 987654, 1, job, caps, 10)
            await limits.settle_async(client, job, 3)
            return taken, admitted
        finally:
            await client.aclose()

    taken, admitted = asyncio.run(main())
    assert taken.allowed and admitted.allowed
    assert not rds.exists(limits.reservation_key(job))  # settled: the reservation record is gone
