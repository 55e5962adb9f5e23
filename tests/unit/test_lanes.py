"""ops/harness.py's one allocator of the test lanes' databases and Redis dbs: for any SPOOL_TEST_LANES,
no lane gets a local Spool's defaults (database `spool` and Redis db 0, in core/config.py), no two lanes or
side stacks share a db, and a count the Redis server cannot serve is refused with the reason."""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from core.config import Settings
from ops import harness

SPOOL_DB = urlsplit(Settings.model_fields["database_url"].default).path.lstrip("/")
SPOOL_REDIS_DB = int(urlsplit(Settings.model_fields["redis_url"].default).path.lstrip("/"))


def _lanes_fitting(databases: int) -> int:
    """The largest SPOOL_TEST_LANES a server of `databases` dbs serves (allocator, not a formula)."""
    n = 1
    while True:
        try:
            harness.xdist_lanes(n + 1, databases)
        except harness.LaneError:
            return n
        n += 1


@pytest.mark.parametrize("databases", [16, 32, 64])
def test_every_lane_count_that_fits_gets_dbs_of_its_own_and_never_the_defaults(databases):
    most = _lanes_fitting(databases)
    assert most >= 2  # what ops/test.sh runs by default
    for count in range(1, most + 1):
        lanes = [harness.WALLCLOCK_LANE, *harness.xdist_lanes(count, databases)]
        assert len(set(lanes)) == count + 1
        dbs = [n for lane in lanes for n in harness.lane_redis_dbs(lane, databases)]
        assert SPOOL_REDIS_DB not in dbs and harness.SPOOL_REDIS_DB == SPOOL_REDIS_DB
        assert all(0 <= n < databases for n in dbs)
        assert len(set(dbs)) == len(dbs), dbs  # no two lanes, nor one lane's two uses, share a db
        assert not set(dbs) & set(harness.SIDE_REDIS_DBS.values())
        names = [harness.lane_database("postgresql+psycopg://u@h/spool_test", lane).rsplit("/", 1)[1] for lane in lanes]
        assert len(set(names)) == len(names) and SPOOL_DB not in names
    assert len(set(harness.SIDE_REDIS_DBS.values())) == len(harness.SIDE_REDIS_DBS)
    assert SPOOL_REDIS_DB not in harness.SIDE_REDIS_DBS.values()


def test_a_count_the_server_cannot_serve_is_refused_with_the_reason():
    # 16 dbs (Redis's default): 0 is Spool's, 8 the side stacks', 6 lanes 0-2's; one is left, half a lane.
    assert _lanes_fitting(16) == 2
    for count in (3, 4, 40):  # were: lane 3 on db 0 (flushed), lane 4 a KeyError
        with pytest.raises(harness.LaneError, match=r"16 dbs.*SPOOL_TEST_LANES=2 at most.*databases"):
            harness.xdist_lanes(count, 16)
    with pytest.raises(harness.LaneError):
        harness.xdist_lanes(0, 16)
    assert harness.xdist_lanes(3, 32) == [0, 1, 3]


def test_the_command_ops_test_sh_asks_refuses_before_anything_runs():
    """`python -m ops.harness lanes N`: the wallclock lane, then N lanes; a count this machine's Redis
    (16 dbs) cannot serve exits 2 with the reason."""
    ok = subprocess.run([sys.executable, "-m", "ops.harness", "lanes", "2"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.split() == ["2", "0", "1"], ok.stderr
    databases = harness.redis_databases(harness.TEST_REDIS)
    over = _lanes_fitting(databases) + 1
    refused = subprocess.run([sys.executable, "-m", "ops.harness", "lanes", str(over)], capture_output=True, text=True)
    assert refused.returncode == 2 and f"SPOOL_TEST_LANES={over}:" in refused.stderr and not refused.stdout


@pytest.mark.parametrize(
    ("db_url", "redis_url"),
    [
        (f"postgresql+psycopg://postgres@127.0.0.1:5432/{SPOOL_DB}", "redis://127.0.0.1:6379/15"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/spool_test", "redis://127.0.0.1:6379/0"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/spool_test", "redis://localhost:6379"),
    ],
)
def test_a_stack_on_spools_own_database_or_redis_db_is_refused(db_url, redis_url):
    with pytest.raises(harness.LaneError):
        harness.refuse_defaults(db_url, redis_url)


def test_a_stack_on_a_redis_server_of_its_own_may_use_db_0():
    harness.refuse_defaults("postgresql+psycopg://postgres@127.0.0.1:5432/spool_test", "redis://127.0.0.1:6390/0")
