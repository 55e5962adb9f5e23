"""Shared fixtures: a real Spool stack (api + worker + dispatcher processes) on the real Postgres and
Redis of this machine, with the real SmolLM2 model. Nothing of ours is mocked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis as redis_lib
from sqlalchemy import create_engine, text

# The one process harness, shared with ops/faults.py; re-exported for the tests that import it from here.
from ops.harness import ROOT, SPOOL, Stack, free_port, wait_for

__all__ = ["MODEL", "ROOT", "SPOOL", "TEST_DB", "TEST_REDIS", "Stack", "free_port", "running_stack", "wait_for"]


def _spool_database_url() -> str:
    """Spool's own database URL (environment, else the .env that ops/services.sh writes on a fresh
    machine), so the tests log in the way Spool does."""
    url = os.environ.get("SPOOL_DATABASE_URL")
    env_file = ROOT / ".env"
    if url is None and env_file.exists():
        for line in env_file.read_text().splitlines():
            if line.startswith("SPOOL_DATABASE_URL="):
                url = line.split("=", 1)[1].strip()
    return url or "postgresql+psycopg://postgres@127.0.0.1:5432/spool"


TEST_DB = os.environ.get("SPOOL_TEST_DATABASE_URL", _spool_database_url().rsplit("/", 1)[0] + "/spool_test")
TEST_REDIS = os.environ.get("SPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# Redis databases the side stacks take on the same server (bare-host rehearsal 2, compose rehearsal 7,
# limits 8, paced and null engines 9, fresh machine 10, registry 12, integration 13, fuzz 14). The session
# stack on one of them shares its live-workers hash with a side stack's, whose "workers live" checks then never hold.
SIDE_REDIS_DBS = {2, 7, 8, 9, 10, 12, 13, 14}
if TEST_REDIS.rsplit("/", 1)[-1] in {str(n) for n in SIDE_REDIS_DBS}:
    raise pytest.UsageError(f"SPOOL_TEST_REDIS_URL: pick a Redis database other than {sorted(SIDE_REDIS_DBS)}")
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def db_url() -> str:
    return TEST_DB


@contextmanager
def running_stack(
    logdir: Path,
    db_url: str,
    redis_url: str,
    extra_workers: tuple[dict[str, str], ...] = (),
    root: Path = ROOT,
    **extra_env: str,
) -> Iterator[Stack]:
    """A whole Spool (api + dispatcher + one worker) on its own database and Redis db, with tenants
    alpha, beta and ops and an admin key, all made fresh; its processes run from checkout `root`."""
    from core.infra.dbadmin import drop_database

    port = free_port()
    env = {
        **os.environ,
        "SPOOL_DATABASE_URL": db_url,
        "SPOOL_REDIS_URL": redis_url,
        "SPOOL_API_PORT": str(port),
        # Short timings so recovery paths run in seconds.
        "SPOOL_LEASE_S": "3",
        "SPOOL_DISPATCH_TIMEOUT_S": "10",
        "SPOOL_DISPATCHER_INTERVAL_S": "0.5",
        "SPOOL_N_CTX": "1024",
        "SPOOL_BATCH_VALIDATION_LEASE_S": "3",
        "SPOOL_WEBHOOK_ALLOW": "127.0.0.1/32",  # the tests' receivers; everything else non-public is refused
        "SPOOL_WEBHOOK_TIMEOUT_S": "4",
        "SPOOL_WEBHOOK_RETRY_S": "0.5",
        "SPOOL_MODEL_ALIASES": '{"gpt-3.5-turbo": "smollm2-135m-instruct", "default": "smollm2-135m-instruct"}',
        "PYTHONUNBUFFERED": "1",
        **extra_env,
    }
    drop_database(db_url)
    redis_lib.Redis.from_url(redis_url).flushdb()
    st = Stack(env=env, logdir=logdir, port=port, root=root)
    st.cli("migrate")
    for tenant in ("alpha", "beta", "ops"):
        st.cli("tenant", "create", tenant)
        st.keys[tenant] = st.cli("key", "create", "--tenant", tenant).splitlines()[-1]
    st.keys["admin"] = st.cli("key", "create", "--tenant", "ops", "--scope", "admin").splitlines()[-1]
    try:
        st.start("api", "api")
        st.metrics_ports["dispatcher"] = free_port()
        st.start("dispatcher", "dispatcher", env={"SPOOL_METRICS_PORT": str(st.metrics_ports["dispatcher"])})
        st.start_worker()
        for i, worker_env in enumerate(extra_workers):  # more workers, e.g. for other models
            name = f"worker-extra{i + 1}"
            st.start(name, "worker", env=worker_env)
            st.wait_log(name, "ready.", 120)
        wait_for(st.ready, 60, "api health")
        yield st
    finally:
        st.stop_all()
        print(f"\nprocess logs in {logdir}")


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
