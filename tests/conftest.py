"""Shared fixtures: a real Spool stack (api + worker + dispatcher processes) on the real Postgres and
Redis of this machine, with the real SmolLM2 model. Nothing of ours is mocked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_lib
from sqlalchemy import create_engine, text

# The one process harness and stack recipe (ops/harness.py), shared with ops; re-exported for the tests
# that import them from here.
try:
    from ops.harness import IT_REDIS, ROOT, SPOOL, TEST_DB, TEST_REDIS, Stack, free_port, running_stack, wait_for
except ValueError as e:  # ops.harness.ShardError: a shard or URL that would reach Spool's own data, or another shard's
    raise pytest.UsageError(str(e)) from e

__all__ = [
    "IT_REDIS",
    "MODEL",
    "ROOT",
    "SPOOL",
    "TEST_DB",
    "TEST_REDIS",
    "Stack",
    "free_port",
    "running_stack",
    "wait_for",
]


MODEL = "smollm2-135m-instruct"

# Seconds a module takes (its tests' calls and its own stacks' start), from the costs table of a full
# run in shards (tests/costs.py; 2026-11-28 23:00, the 2-core VM, 45d9df9). ops/test.sh's shards take
# modules in this order, longest first, so that no long module starts last while the other shard
# idles; modules not listed follow in their own order. The wallclock shard
# (the modules marked so) takes its own in the same order.
COSTS = {
    "tests/e2e/test_protocol.py": 129,
    "tests/e2e/test_cluster.py": 120,
    "tests/e2e/test_long_outages.py": 104,
    "tests/e2e/test_image_replay.py": 99,
    "tests/e2e/test_faults.py": 82,
    "tests/integration/test_constrained_samples.py": 80,
    "tests/e2e/test_batches.py": 57,
    "tests/e2e/test_client_pauses.py": 52,
    "tests/e2e/test_chat.py": 44,
    "tests/integration/test_llamacpp_engine.py": 43,
    "tests/e2e/test_lm_eval.py": 39,
    "tests/e2e/test_fuzz.py": 34,
    "tests/e2e/test_responses.py": 30,
    "tests/e2e/test_clients.py": 26,
    "tests/e2e/test_dead_host.py": 26,
    "tests/e2e/test_idempotency_hold.py": 26,
    "tests/e2e/test_reliability.py": 25,
    "tests/e2e/test_model_registry.py": 24,
    "tests/e2e/test_paced_engine.py": 22,
    "tests/e2e/test_status_page.py": 20,
    "tests/e2e/test_durability.py": 20,
    "tests/e2e/test_peer_fidelity.py": 20,
    "tests/e2e/test_tenancy.py": 20,
    "tests/e2e/test_bare_host_rehearsal.py": 25,
    "tests/e2e/test_token_fairness.py": 140,  # wallclock: the paced engine's sleeps
    "tests/integration/test_token_fairness.py": 45,
    "tests/e2e/test_chat_store.py": 35,
    "tests/e2e/test_scale_from_zero.py": 31,  # wallclock
    "tests/unit/test_gpu_proof.py": 30,
    "tests/e2e/test_fairness.py": 18,
    "tests/e2e/test_outages.py": 17,
    "tests/e2e/test_fresh_machine.py": 16,
    "tests/e2e/test_compose_rehearsal.py": 14,
    "tests/integration/test_redis_refusals.py": 13,
    "tests/e2e/test_webhooks.py": 10,
    "tests/integration/test_pool_idle.py": 10,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -COSTS.get(item.nodeid.split("::", 1)[0], 0))  # stable: ties keep their order


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
