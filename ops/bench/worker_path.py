"""CPU per short job of the worker's own path, in-process and without Celery: claim, one attempt on
the null engine (`max_tokens` 1), end (transition, usage, settlement, terminal event). Less noisy on a
shared machine than the paced stack's per-process CPU, where this path is a third of the worker's.

    SPOOL_TEST_DATABASE_URL=... SPOOL_TEST_REDIS_URL=... python ops/bench/worker_path.py ROOT [N]

ROOT is a checkout (a `git worktree` of an older commit, say): its code is measured, on a database
already migrated (an integration-test database) and a Redis database it writes job streams into.
Run it for each checkout in turn, twice, and compare in one sitting.
"""

from __future__ import annotations

import os
import sys
import time
import uuid


def main() -> None:
    root, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300
    sys.path.insert(0, root)
    os.chdir(root)
    import redis
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from core.config import Settings
    from core.infra.db import ping_when_idle
    from core.states import JobState
    from ops import factories
    from workers.engine.loop import EngineLoop
    from workers.engine.null import NullEngine
    from workers.runner import JobRunner

    db = os.environ["SPOOL_TEST_DATABASE_URL"]
    settings = Settings(database_url=db, redis_url=os.environ["SPOOL_TEST_REDIS_URL"], max_attempts=2)
    engine = ping_when_idle(create_engine(db, pool_size=10, max_overflow=20))  # as core/infra/db.py
    sessions = sessionmaker(engine, expire_on_commit=False)
    runner = JobRunner(
        EngineLoop(NullEngine("smollm2-135m-instruct", n_ctx=512, max_batch=64)),
        settings,
        redis.Redis.from_url(settings.redis_url),
        sessions,
        "w-path",
    )
    with sessions() as s:
        t = factories.tenant(s, name="path-" + uuid.uuid4().hex)
        p = factories.params(max_tokens=1)
        ids = [factories.job(s, t, state=JobState.dispatched, params=p).id for _ in range(n + 20)]
    for job_id in ids[:20]:  # warm-up: pools, compiled statements, prepared statements
        runner.run(job_id, 1)
    cpu, wall = time.process_time(), time.perf_counter()
    for job_id in ids[20:]:
        assert runner.run(job_id, 1) == "succeeded"
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"{root}: worker path CPU {1000 * cpu / n:.3f} ms/job, wall {1000 * wall / n:.2f} ms/job", flush=True)
    os._exit(0)  # the engine loop's thread is not stopped


if __name__ == "__main__":
    main()
