"""Shared fixtures: a real Spool stack (api + worker + dispatcher processes) on the real Postgres and
Redis of this machine, with the real SmolLM2 model. Nothing of ours is mocked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_lib
from sqlalchemy import create_engine, text

# The one process harness and stack recipe (ops/harness.py), shared with ops; re-exported for the tests
# that import them from here.
from ops.harness import ROOT, SPOOL, TEST_DB, TEST_REDIS, Stack, free_port, running_stack, wait_for

__all__ = ["MODEL", "ROOT", "SPOOL", "TEST_DB", "TEST_REDIS", "Stack", "free_port", "running_stack", "wait_for"]


# Redis databases the side stacks take on the same server (bare-host rehearsal 2, compose rehearsal 7,
# limits 8, paced and null engines 9, fresh machine 10, registry 12, integration 13, fuzz 14). The
# session stack on one of them shares its live-workers hash with a side stack's, whose "workers live"
# checks then never hold.
SIDE_REDIS_DBS = {2, 7, 8, 9, 10, 12, 13, 14}
if TEST_REDIS.rsplit("/", 1)[-1] in {str(n) for n in SIDE_REDIS_DBS}:
    raise pytest.UsageError(f"SPOOL_TEST_REDIS_URL: pick a Redis database other than {sorted(SIDE_REDIS_DBS)}")
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def db_url() -> str:
    return TEST_DB


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("logs"), TEST_DB, TEST_REDIS) as st:
        yield st


@pytest.fixture(autouse=True)
def _stack_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves the shared stack as it found it: what a test killed or paused of its api,
    dispatcher and worker and did not bring back (an assertion failed first) is started again here,
    so a later test does not run without it."""
    st: Stack | None = request.getfixturevalue("stack") if "stack" in request.fixturenames else None
    yield
    if st is not None and (started := st.restore()):
        print(f"\nstarted again after {request.node.nodeid}: {', '.join(started)}")


@pytest.fixture(scope="session")
def db(stack: Stack):
    engine = create_engine(TEST_DB)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def rds(stack: Stack) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(TEST_REDIS, decode_responses=True)


def job_row(db, job_id: str) -> dict:
    with db.connect() as conn:
        return dict(conn.execute(text("SELECT * FROM jobs WHERE id = :i"), {"i": job_id}).mappings().one())


def count_jobs(db) -> int:
    with db.connect() as conn:
        return conn.scalar(text("SELECT count(*) FROM jobs"))
