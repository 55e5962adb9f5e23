"""ops/harness.py's one allocator of the test shards' databases and Redis dbs: for any SPOOL_TEST_SHARDS,
no shard gets a local Spool's defaults (database `spool` and Redis db 0, in core/config.py), no two shards or
side stacks share a db, and a count the Redis server cannot serve is refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from core.config import Settings
from ops import harness

SPOOL_DB = urlsplit(Settings.model_fields["database_url"].default).path.lstrip("/")
SPOOL_REDIS_DB = int(urlsplit(Settings.model_fields["redis_url"].default).path.lstrip("/"))


def _shards_fitting(databases: int) -> int:
    """The largest SPOOL_TEST_SHARDS a server of `databases` dbs serves (allocator, not a formula)."""
    n = 1
    while True:
        try:
            harness.xdist_shards(n + 1, databases)
        except harness.ShardError:
            return n
        n += 1


@pytest.mark.parametrize("databases", [16, 32, 64])
def test_every_shard_count_that_fits_gets_dbs_of_its_own_and_never_the_defaults(databases):
    most = _shards_fitting(databases)
    assert most >= 2  # what ops/test.sh runs by default
    for count in range(1, most + 1):
        shards = [harness.WALLCLOCK_SHARD, *harness.xdist_shards(count, databases)]
        assert len(set(shards)) == count + 1
        dbs = [n for shard in shards for n in harness.shard_redis_dbs(shard, databases)]
        assert SPOOL_REDIS_DB not in dbs and harness.SPOOL_REDIS_DB == SPOOL_REDIS_DB
        assert all(0 <= n < databases for n in dbs)
        assert len(set(dbs)) == len(dbs), dbs  # no two shards, nor one shard's two uses, share a db
        assert not set(dbs) & set(harness.SIDE_REDIS_DBS.values())
        names = [
            harness.shard_database("postgresql+psycopg://u@h/spool_test", shard).rsplit("/", 1)[1] for shard in shards
        ]
        assert len(set(names)) == len(names) and SPOOL_DB not in names
    assert len(set(harness.SIDE_REDIS_DBS.values())) == len(harness.SIDE_REDIS_DBS)
    assert SPOOL_REDIS_DB not in harness.SIDE_REDIS_DBS.values()


def test_a_count_the_server_cannot_serve_is_refused_with_the_reason():
    # 16 dbs (Redis's default): 0 is Spool's, 8 the side stacks', 6 shards 0-2's; one is left, half a shard.
    assert _shards_fitting(16) == 2
    for count in (3, 4, 40):  # were: shard 3 on db 0 (flushed), shard 4 a KeyError
        with pytest.raises(harness.ShardError, match=r"16 dbs.*SPOOL_TEST_SHARDS=2 at most.*databases"):
            harness.xdist_shards(count, 16)
    with pytest.raises(harness.ShardError):
        harness.xdist_shards(0, 16)
    assert harness.xdist_shards(3, 32) == [0, 1, 3]


def test_the_command_ops_test_sh_asks_refuses_before_anything_runs():
    """`python -m ops.harness shards N`: the wallclock shard, then N shards; a count this machine's Redis
    (16 dbs) cannot serve exits 2 with the reason."""
    ok = subprocess.run([sys.executable, "-m", "ops.harness", "shards", "2"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.split() == ["2", "0", "1"], ok.stderr
    databases = harness.redis_databases(harness.TEST_REDIS)
    over = _shards_fitting(databases) + 1
    refused = subprocess.run([sys.executable, "-m", "ops.harness", "shards", str(over)], capture_output=True, text=True)
    assert refused.returncode == 2 and f"SPOOL_TEST_SHARDS={over}:" in refused.stderr and not refused.stdout


@pytest.mark.parametrize(
    ("db_url", "redis_url"),
    [
        (f"postgresql+psycopg://postgres@127.0.0.1:5432/{SPOOL_DB}", "redis://127.0.0.1:6379/15"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/spool_test", "redis://127.0.0.1:6379/0"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/spool_test", "redis://localhost:6379"),
    ],
)
def test_a_stack_on_spools_own_database_or_redis_db_is_refused(db_url, redis_url):
    with pytest.raises(harness.ShardError):
        harness.refuse_defaults(db_url, redis_url)


def test_a_stack_on_a_redis_server_of_its_own_may_use_db_0():
    harness.refuse_defaults("postgresql+psycopg://postgres@127.0.0.1:5432/spool_test", "redis://127.0.0.1:6390/0")


def test_a_stack_on_a_postgres_of_its_own_may_name_its_database_spool():
    """A long outage's private Postgres (tests/e2e/test_long_outages.py) on another port: not Spool's."""
    harness.refuse_defaults(f"postgresql+psycopg://postgres@127.0.0.1:56875/{SPOOL_DB}", "redis://127.0.0.1:6390/0")
    with pytest.raises(harness.ShardError):  # localhost is 127.0.0.1, and 5432 the default port
        harness.refuse_defaults(f"postgresql+psycopg://postgres@localhost/{SPOOL_DB}", "redis://127.0.0.1:6390/0")


def test_the_old_name_spool_test_lane_still_picks_the_shard():
    """SPOOL_TEST_SHARD was SPOOL_TEST_LANE: a run started with the old name still gets its own shard,
    not shard 0's database and Redis dbs; the new name wins where both are set."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPOOL_TEST_SHARD", "SPOOL_TEST_LANE")}
    show = "from ops import harness; print(harness.SHARD, harness.TEST_DB.rsplit('/', 1)[1])"
    got = []
    for given in ({"SPOOL_TEST_LANE": "1"}, {"SPOOL_TEST_SHARD": "1", "SPOOL_TEST_LANE": "2"}):
        out = subprocess.run([sys.executable, "-c", show], env={**env, **given}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        got.append(out.stdout.split())
    assert got[0] == got[1] and got[0][0] == "1" and got[0][1].endswith("_shard1"), got
