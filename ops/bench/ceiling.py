"""Where one Postgres and one Redis top out on this machine under Spool's own work, driven by clients
cheap enough to push them there (issue 39). Spool's Python processes cost ten times what Postgres
and Redis do per job and per token, so on a small host they saturate the cores long before either
server does; here the servers get the load on their own.

    python -m ops.bench.ceiling [--clients 1,2,4,8,16] [--seconds 8] [--json out.json]

**Postgres**: the statements one job costs the ledger, captured from Spool's own code on a database
of the bench's own (`spool_ceiling`, cloned from the migrated template): the job's row as the test
factory stores it (the API's group commit writes the same row, a burst of them in one statement),
the worker's claim (compare-and-set on state and attempt) and its ending (the row's result and usage,
and the tenant's daily usage row upserted, in one statement). Each is inlined with its parameters
(psycopg's client-side binding) and replayed by `pgbench` (C; one connection per client, each a
tenant of its own, every transaction a new job id; prepared statements, as psycopg prepares Spool's
repeated ones). Per level: jobs a second and Postgres's CPU
(every backend of that database and the server's own background processes) in cores.

**Redis**: the per-token write, Spool's fenced-append script (`core/infra/streams/write.append_many`) with
64 jobs' entries per call, what the worker's stream pump sends each decode step at 64 streams; N
Python processes, fresh job ids each round, on a private redis-server (no persistence). Per level:
stream entries a second and Redis's CPU in cores. The API's reads (one shared XREAD per process)
are not driven here.

The machine should be otherwise idle; the drivers share its cores with the server they load, so
a level past the core count measures the machine, not the server. `docs/scaling.md` has the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ops.bench.paced import TICK, private_redis, tree_cpu, tree_meter

DATABASE = "spool_ceiling"
JOBS_PER_CALL = 64


# -- Postgres ---------------------------------------------------------------------------------------
def postmaster_meter() -> Any:
    """The whole Postgres server's CPU seconds so far: the postmaster and its live children, and the
    children it has reaped (pgbench's backends end with each level). Every database's: the machine
    should be otherwise idle."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                exe = os.readlink(f"/proc/{d}/exe")
                parent = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]
            except OSError:
                continue
            try:
                parent_exe = os.readlink(f"/proc/{parent}/exe")
            except OSError:  # pid 1 of a container may not be readable
                parent_exe = ""
            if exe.endswith("/bin/postgres") and not parent_exe.endswith("/bin/postgres"):
                pids.append(int(d))
    if len(pids) != 1:
        raise SystemExit(f"expected one Postgres server here, found {len(pids)}")
    pid = pids[0]

    def read() -> float:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return tree_cpu({"pg": pid})["pg"] + (int(f[13]) + int(f[14])) / TICK

    return read


def captured_job(db_url: str, redis_url: str) -> tuple[list[str], int]:
    """One job's statements as the ledger runs them (insert, claim, end), each inlined with its
    parameters; and the id of the tenant they were captured for."""
    import psycopg
    import redis
    from sqlalchemy import create_engine, event
    from sqlalchemy.orm import sessionmaker

    from core.config import Settings
    from core.states import JobState
    from ops import factories
    from workers.engine.loop import EngineLoop
    from workers.engine.null import NullEngine
    from workers.runner import JobRunner

    settings = Settings(database_url=db_url, redis_url=redis_url, max_attempts=2)
    engine = create_engine(db_url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    runner = JobRunner(
        EngineLoop(NullEngine("smollm2-135m-instruct", n_ctx=512, max_batch=64)),
        settings,
        redis.Redis.from_url(redis_url),
        sessions,
        "w-ceiling",
    )
    seen: list[tuple[str, Any]] = []

    @event.listens_for(engine, "before_cursor_execute")
    def keep(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append((statement, parameters))

    with sessions() as s:
        t = factories.tenant(s, name="ceiling-" + uuid.uuid4().hex)
        tenant = t.id
        job_id = factories.job(s, t, state=JobState.dispatched, params=factories.params(max_tokens=1)).id
    assert runner.run(job_id, 1) == "succeeded"
    event.remove(engine, "before_cursor_execute", keep)
    with psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql")) as raw:
        inline = psycopg.ClientCursor(raw)
        texts = [inline.mogrify(st, params) for st, params in seen if job_id in str(params)]
    engine.dispose()
    return texts, tenant


def pgbench_script(statements: list[str], job_id_pattern: str, tenant: int) -> str:
    """The captured job as one pgbench transaction: a new job id each time, the client's own tenant."""
    out = ["\\set n random(1, 9000000000000000000)", "\\set tenant :t0 + :client_id", "BEGIN;"]
    for st in statements:
        st = re.sub(f"'{job_id_pattern}'", "('pgb-' || :client_id || '-' || :n)", st)
        if st.startswith("INSERT INTO jobs"):
            st = st.replace(f"::VARCHAR, {tenant}::BIGINT,", "::VARCHAR, :tenant::BIGINT,", 1)
        out += [" ".join(st.split()) + ";", "COMMIT;", "BEGIN;"]  # each statement its own transaction
    return "\n".join(out[:-1]) + "\n"


def postgres_levels(db_url: str, redis_url: str, levels: list[int], seconds: float) -> list[dict]:
    from sqlalchemy import create_engine

    from ops import factories

    statements, tenant = captured_job(db_url, redis_url)
    assert len(statements) == 3, [s[:60] for s in statements]  # insert, claim, end
    job_id = re.search(r"'(cmpl-[0-9a-f]+)'", statements[1])
    assert job_id is not None
    # Every client a tenant of its own (ids t0 ... t0+max(levels)-1): the daily usage row is per tenant.
    from sqlalchemy.orm import Session

    engine = create_engine(db_url)
    with Session(engine) as s:
        ids = [factories.tenant(s, name=f"ceiling-{i}-{uuid.uuid4().hex[:6]}").id for i in range(max(levels) + 1)]
    engine.dispose()
    assert ids == list(range(ids[0], ids[0] + len(ids))), "tenant ids not consecutive"
    script = Path(tempfile.mkdtemp(prefix="spool-ceiling-")) / "job.sql"
    script.write_text(pgbench_script(statements, re.escape(job_id.group(1)), tenant))
    conninfo = db_url.replace("postgresql+psycopg://", "postgresql://")
    meter = postmaster_meter()
    rows = []
    for clients in levels:
        cpu, wall = meter(), time.monotonic()
        out = subprocess.run(
            [
                *["pgbench", "-n", "-M", "prepared", "-f", str(script), "-c", str(clients), "-j", str(min(clients, 2))],
                *["-T", str(int(seconds)), "-D", f"t0={ids[0]}", conninfo],
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        cpu, wall = meter() - cpu, time.monotonic() - wall
        done = int(re.search(r"number of transactions actually processed: (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
        failed = re.search(r"number of failed transactions: (\d+)", out.stdout)
        rows.append(
            {
                "server": "postgres",
                "clients": clients,
                "jobs_s": done / wall,
                "failed": int(failed.group(1)) if failed else 0,
                "server_cores": cpu / wall,
                "server_cpu_ms_per_job": 1000 * cpu / max(done, 1),
            }
        )
        print(_row(rows[-1]), flush=True)
    return rows


# -- Redis ------------------------------------------------------------------------------------------
def _redis_driver(redis_url: str, seconds: float, counter: Any) -> None:
    import redis

    from core.infra.streams import keys, write

    r = redis.Redis.from_url(redis_url)
    payload = json.dumps({"k": "token", "t": " word", "i": 0})
    deadline, done, n = time.monotonic() + seconds, 0, 0
    tag = uuid.uuid4().hex[:8]
    jobs = [f"ceil-{tag}-{i}" for i in range(JOBS_PER_CALL)]
    write.raise_fences(r, [(job, 1) for job in jobs], 600)  # as each attempt does after its claim
    while time.monotonic() < deadline:
        appends = [write.Append(job, 1, [payload], 600, n % 256 + 1) for job in jobs]
        got = write.append_many(r, appends)
        assert all(isinstance(g, list) for g in got), got[:2]
        done += len(appends)
        n += 1
        if n % 256 == 0:  # a stream per job no longer than a long answer, then new ones, as new requests
            r.delete(*(keys.stream_key(job) for job in jobs))
    with counter.get_lock():
        counter.value += done


def redis_levels(redis_url: str, pid: int, levels: list[int], seconds: float) -> list[dict]:
    meter = tree_meter(pid)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for procs in levels:
        counter = ctx.Value("q", 0)
        workers = [ctx.Process(target=_redis_driver, args=(redis_url, seconds, counter)) for _ in range(procs)]
        for w in workers:
            w.start()
        time.sleep(1.5)  # the drivers' imports and fences before the clock starts
        cpu0, t0, n0 = meter(), time.monotonic(), 0
        for w in workers:
            w.join()
        cpu, wall = meter() - cpu0, time.monotonic() - t0
        entries = counter.value - n0
        # The drivers ran `seconds` each from their own start; the clock above started 1.5 s in.
        rate = entries / seconds
        rows.append(
            {
                "server": "redis",
                "clients": procs,
                "entries_s": rate,
                "server_cores": cpu / wall,
                "server_cpu_us_per_entry": 1e6 * cpu / max(rate * wall, 1),
            }
        )
        print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict) -> str:
    if r["server"] == "postgres":
        return (
            f"postgres  clients {r['clients']:>3}: {r['jobs_s']:8.0f} jobs/s  (failed {r['failed']})"
            f"  server {r['server_cores']:.2f} cores, {r['server_cpu_ms_per_job']:.3f} ms CPU/job"
        )
    return (
        f"redis     drivers {r['clients']:>3}: {r['entries_s']:8.0f} entries/s"
        f"  server {r['server_cores']:.2f} cores, {r['server_cpu_us_per_entry']:.1f} us CPU/entry"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,2,4,8,16", help="pgbench clients per level")
    ap.add_argument("--drivers", default="1,2,3", help="Redis driver processes per level")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args(argv)
    from ops import harness

    db_url = harness.TEST_DB.rsplit("/", 1)[0] + "/" + DATABASE
    harness.migrated_database(db_url)
    rows: list[dict] = []
    with private_redis() as (redis_url, pid):
        rows += postgres_levels(db_url, redis_url, [int(c) for c in a.clients.split(",")], a.seconds)
        rows += redis_levels(redis_url, pid, [int(c) for c in a.drivers.split(",")], a.seconds)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))
    os._exit(0)  # the capture's engine loop thread is not stopped


if __name__ == "__main__":
    main()
