"""The process harness the tests (tests/conftest.py, tests/sse.py) and the fault harness
(ops/faults.py) share: Spool's processes as a `Stack`, a free port, waiting on a condition, and a
strict SSE reader (so the wire format is checked by our own code, not a client's)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis as redis_lib

# A client's read timeout in tests: a guard against a hang, never a speed check. The heaviest
# requests (50 constrained samples, a chat run to the end of its context) take 20 s on a quiet
# 2-core machine and over 120 s when other processes share its cores (the CPU engine's threads
# wait on each other); pytest-timeout (600 s a test) stays the backstop.
CLIENT_TIMEOUT_S = 480


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.2,
    tolerate: tuple[type[BaseException], ...] = (),
) -> Any:
    """The predicate's first truthy value, polled every `interval`; TimeoutError naming `what`.
    `tolerate`: exceptions that count as "not yet" (a service still starting, or restarting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except tolerate:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


ROOT = Path(__file__).resolve().parent.parent
SPOOL = [sys.executable, "-m", "core.cli"]
CORE = ("api", "dispatcher", "worker")  # the processes a whole Spool is made of


def refuse_writes(rds: redis_lib.Redis, how: str, snapshots: Path) -> Callable[[], None]:
    """Put a Redis that serves into refusing writes, as `OOM` (past `maxmemory` under `noeviction`)
    or `MISCONF` (its snapshot directory gone); returns what lifts the refusal. `snapshots` is the
    server's `dir` (fixed at start)."""
    if how == "oom":
        rds.config_set("maxmemory-policy", "noeviction")
        rds.config_set("maxmemory", "1")  # any write now exceeds it

        def lift_oom() -> None:
            rds.config_set("maxmemory", "0")

        return lift_oom
    shutil.rmtree(snapshots, ignore_errors=True)  # the disk is gone: the next snapshot fails
    # Writes stop after a failed snapshot only while save points are set; Redis then retries the
    # snapshot every few seconds itself, so one may be running already: BGSAVE then errors "in
    # progress" (its SCHEDULE option waits for an AOF rewrite only), and that one fails as well.
    rds.config_set("save", "3600 1")
    rds.config_set("stop-writes-on-bgsave-error", "yes")
    try:
        rds.bgsave()
    except redis_lib.ResponseError as exc:
        if "in progress" not in str(exc):
            raise

    def failed() -> bool:
        info = rds.info("persistence")
        return int(info["rdb_bgsave_in_progress"]) == 0 and info["rdb_last_bgsave_status"] == "err"

    wait_for(failed, 30, "a failed snapshot")

    def lift() -> None:
        snapshots.mkdir(exist_ok=True)
        rds.config_set("save", "")  # no save points: the failed snapshot no longer stops writes

    return lift


@dataclass
class Stack:
    """Spool's own processes, started with `spool` as an operator would, on the environment given
    (database, Redis, port, timings), each logging to `<logdir>/<name>.log`. Built by the tests
    (ops/harness.running_stack) and by the fault harness (ops/faults.py); either kills processes
    and starts them again under the same name."""

    env: dict[str, str]
    logdir: Path
    port: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    _worker_n: int = 0
    worker_name: str = ""
    metrics_ports: dict[str, int] = field(default_factory=dict)  # process name -> its /metrics port
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # process name -> its env overrides
    worker_metrics: bool = True  # each worker serves /metrics on a port of its own
    root: Path = ROOT  # the checkout the processes run from (the bench compares two side by side)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> str:
        out = subprocess.run([*SPOOL, *args], env=self.env, capture_output=True, text=True, timeout=120, cwd=self.root)
        if out.returncode != 0:
            raise RuntimeError(f"spool {' '.join(args)} failed: {out.stderr[-2000:]}")
        return out.stdout.strip()

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        # A process restarted under the same name (a test killed it) gets the same overrides again.
        if env is not None:
            self.envs[name] = env
        env = self.envs.get(name, {})
        log = open(self.logdir / f"{name}.log", "ab")  # the process owns it
        proc = subprocess.Popen(
            [*SPOOL, *args], env={**self.env, **env}, cwd=self.root, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def wait_log(self, name: str, text: str, timeout: float) -> None:
        """Until `text` is in the process's log; RuntimeError if the process exits first."""
        proc = self.procs[name]
        wait_for(lambda: text in self.log(name) or proc.poll() is not None, timeout, f"{name}: {text!r}")
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {self.log(name)[-3000:]}")

    def start_worker(self) -> subprocess.Popen:
        """A new worker (worker1, worker2, ...: a log each), ready to take jobs; `procs["worker"]`."""
        self._worker_n += 1
        name = f"worker{self._worker_n}"
        env = {}
        if self.worker_metrics:
            self.metrics_ports["worker"] = free_port()
            env["SPOOL_METRICS_PORT"] = str(self.metrics_ports["worker"])
        proc = self.start(name, "worker", env=env)
        self.wait_log(name, "ready.", 120)
        self.procs["worker"] = proc
        self.worker_name = name
        return proc

    def signal(self, name: str, sig: int) -> None:
        """Send a process a signal and wait for it to end (killed if it takes over 30 s)."""
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def kill_worker(self) -> None:
        self.signal("worker", signal.SIGKILL)

    def up(self) -> bool:
        """The API answers (/health)."""
        try:
            return httpx.get(self.base_url + "/health", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def ready(self) -> bool:
        """The API, its Postgres and Redis, and a live worker per model (/ready)."""
        try:
            return httpx.get(self.base_url + "/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def start_api(self) -> None:
        self.start("api", "api")
        wait_for(self.up, 60, "api up")

    def restore(self) -> list[str]:
        """Start again whichever of api, dispatcher and worker is gone, and continue a paused one:
        what a test (or a fault) took away, given back. Returns the names started."""
        started = []
        for name in CORE:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # harmless unless it was SIGSTOPped
                continue
            if name == "worker":
                self.start_worker()
            elif name == "api":
                self.start_api()
            else:
                self.start(name, name)
            started.append(name)
        return started

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()

    # -- clients of the stack -----------------------------------------------------------------------
    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=CLIENT_TIMEOUT_S)

    def new_tenant(self, name: str, **limits: Any) -> str:
        """Create a tenant through /admin and return a fresh user key for it."""
        with self.http(self.keys["admin"]) as admin:
            r = admin.post("/admin/tenants", json={"name": name, **limits})
            assert r.status_code == 201, r.text
            r = admin.post(f"/admin/tenants/{name}/keys", json={"name": "test"})
            assert r.status_code == 201, r.text
            return r.json()["key"]

    def openai(self, tenant: str = "alpha"):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=self.keys[tenant], max_retries=0, timeout=CLIENT_TIMEOUT_S
        )


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)


def events(resp: httpx.Response) -> Iterator[Event]:
    """Server-sent events as the spec reads them: `data:` lines joined, one leading space dropped,
    comments (`:` keep-alives) skipped, an event dispatched at a blank line."""
    ev_id: str | None = None
    data: list[str] = []
    for line in resp.iter_lines():
        if line == "":
            if data:
                yield Event(ev_id, "\n".join(data))
            ev_id, data = None, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "id":
                ev_id = value
    if data:
        yield Event(ev_id, "\n".join(data))


# -- the stack recipe: what the tests, the hostile harness and the benches start ----------------------


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
# The integration tests' Redis db (tests/integration); the stack's db server, database 13 by default.
IT_REDIS = os.environ.get("SPOOL_IT_REDIS_URL", TEST_REDIS.rsplit("/", 1)[0] + "/13")

# llama.cpp threads for an engine a test builds in process, as SPOOL_N_THREADS sets them for a stack's
# workers (ops/test.sh: one per shard; None: every core).
ENGINE_THREADS = int(os.environ.get("SPOOL_N_THREADS") or 0) or None

# -- test shards: each pytest process's database and Redis dbs, from this one allocator ---------------
# ops/test.sh runs the suite in shards, pytest processes side by side (pytest-xdist workers, and the
# wallclock tests' own process), each started with SPOOL_TEST_SHARD=n: a shard past the first takes a
# database and two Redis dbs of its own (stack, integration), so two shards' stacks never meet. The tests
# drop and flush what they are given, so no shard is ever given a developer's own Spool: core/config.py's
# database (`spool`) and Redis db 0.
SPOOL_REDIS_DB = 0
# The side stacks' Redis dbs (on the stack's server), each one module's: a module runs in one shard. A
# shard's stack on one of them would share its live-workers hash with the side stack's, whose "workers
# live" checks then never hold.
SIDE_REDIS_DBS = {
    "bare_host": 2,
    "paced": 5,
    "compose": 7,
    "limits": 8,
    "null_engine": 9,
    "fresh_machine": 10,
    "registry": 12,
    "fuzz": 14,
    "fairness": 1,
}
# (stack, integration) of the shards a 16-db Redis (the default) holds: 0 (a plain pytest), 1, and 2 (the
# wallclock tests'). Shards past them take free dbs two by two, from a server with more (redis.conf).
FIXED_SHARDS = {0: (15, 13), 1: (3, 4), 2: (6, 11)}
WALLCLOCK_SHARD = 2


class ShardError(ValueError):
    """A shard (or a shard count) this Redis server cannot serve without the defaults or a shared db."""


def shard_redis_dbs(shard: int, databases: int = 16) -> tuple[int, int]:
    """`shard`'s (stack, integration) Redis dbs on a server of `databases` dbs; ShardError if it has none
    left for it."""
    if shard in FIXED_SHARDS:
        return FIXED_SHARDS[shard]
    taken = {SPOOL_REDIS_DB, *SIDE_REDIS_DBS.values(), *(n for pair in FIXED_SHARDS.values() for n in pair)}
    free = [n for n in range(databases) if n not in taken]
    i = 2 * (shard - len(FIXED_SHARDS))
    if shard < 0 or i + 2 > len(free):
        most = len(FIXED_SHARDS) - 1 + len(free) // 2
        raise ShardError(
            f"test shard {shard} needs two Redis dbs of its own, and this Redis server has {databases} dbs: db "
            f"{SPOOL_REDIS_DB} is a local Spool's and {len(taken) - 1} are the lower shards' and the side stacks', "
            f"so shards 0..{most} fit (SPOOL_TEST_SHARDS={most} at most); raise `databases` in redis.conf "
            "for more"
        )
    return free[i], free[i + 1]


def xdist_shards(count: int, databases: int = 16) -> list[int]:
    """The shards of ops/test.sh's `count` pytest-xdist workers (the wallclock shard runs beside them);
    ShardError when `count` is not a whole number of shards this server can serve."""
    if count < 1:
        raise ShardError(f"{count} shards: at least one")
    shards = [n for n in range(count + 1) if n != WALLCLOCK_SHARD][:count]
    for shard in shards:
        shard_redis_dbs(shard, databases)
    return shards


def redis_databases(url: str) -> int:
    """How many dbs the Redis server at `url` has (16 where CONFIG is refused: Redis's default)."""
    try:
        value = redis_lib.Redis.from_url(url).config_get("databases").get("databases")
    except redis_lib.RedisError:
        return 16
    return int(value) if value else 16


def shard_database(base_url: str, shard: int) -> str:
    """`shard`'s database: `base_url`'s (spool_test by default), with `_shard<n>` past shard 0."""
    return f"{base_url}_shard{shard}" if shard else base_url


def _db_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def _db_place(url: str) -> tuple[str, int, str]:
    """(host, port, database) of a Postgres URL, the defaults filled in and localhost spelled one way."""
    u = urlsplit(url)
    host = u.hostname or "127.0.0.1"
    return ("127.0.0.1" if host == "localhost" else host), u.port or 5432, _db_name(url)


def _redis_db(url: str) -> tuple[str, int, int]:
    """(host, port, db) of a Redis URL, Redis's defaults filled in."""
    u = urlsplit(url)
    return u.hostname or "localhost", u.port or 6379, int(u.path.lstrip("/") or 0)


def _spools_redis(url: str) -> bool:
    """Whether `url` is Spool's default Redis db (core/config.py): a developer's local Spool."""
    host, port, db = _redis_db(url)
    return host in ("127.0.0.1", "localhost") and port == 6379 and db == SPOOL_REDIS_DB


def refuse_defaults(db_url: str, redis_url: str) -> None:
    """ShardError when a stack would drop Spool's own database or flush its Redis db."""
    # The same database on the same server: a private Postgres of a test's own (a long outage's) may
    # name its database `spool` freely.
    if _db_place(db_url) == _db_place(_spool_database_url()):
        raise ShardError(f"{db_url}: a test stack would drop Spool's own database; name another")
    if _spools_redis(redis_url):
        raise ShardError(f"{redis_url}: a test stack would flush a local Spool's Redis db; name another")


# SPOOL_TEST_LANE: the name SPOOL_TEST_SHARD had before issue 52, still read.
SHARD = int(os.environ.get("SPOOL_TEST_SHARD") or os.environ.get("SPOOL_TEST_LANE") or 0)
_SERVER = TEST_REDIS.rsplit("/", 1)[0]
if SHARD:
    TEST_DB = shard_database(TEST_DB, SHARD)
    _dbs = 16 if SHARD in FIXED_SHARDS else redis_databases(TEST_REDIS)
    TEST_REDIS, IT_REDIS = (f"{_SERVER}/{n}" for n in shard_redis_dbs(SHARD, _dbs))
for _url in (TEST_REDIS, IT_REDIS):
    if _spools_redis(_url) or _redis_db(_url)[2] in SIDE_REDIS_DBS.values():
        raise ShardError(
            f"{_url}: a shard's Redis db is neither Spool's nor a side stack's {sorted(SIDE_REDIS_DBS.values())}"
        )
if TEST_REDIS == IT_REDIS:
    raise ShardError(f"{TEST_REDIS}: the stack's and the integration tests' Redis dbs are two")
refuse_defaults(TEST_DB, TEST_REDIS)


def side_redis(name: str) -> str:
    """The Redis URL of a side stack (SIDE_REDIS_DBS), on the session stack's server."""
    return f"{_SERVER}/{SIDE_REDIS_DBS[name]}"


def migrated_database(db_url: str, env: dict[str, str] | None = None) -> None:
    """`db_url`'s database made anew at the migrations' head, cloned from a template database that
    `spool migrate` built once for this content of `migrations/` (CREATE DATABASE ... TEMPLATE takes
    a fraction of a second; a migrate subprocess per stack took seconds, ten stacks a suite). Older
    templates are dropped when a new one is published."""
    import hashlib

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from core.infra.dbadmin import drop_database

    digest = hashlib.sha256()
    for f in sorted((ROOT / "migrations").rglob("*.py")):
        digest.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    template = f"spool_tpl_{digest.hexdigest()[:16]}"
    drop_database(db_url)
    url = make_url(db_url)
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:

            def exists(name: str) -> bool:
                return conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}) is not None

            if not exists(template):
                building = f"{template}_{os.getpid()}"  # published by a rename: never seen half-built
                conn.execute(text(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)'))
                with_url = {
                    **(env or os.environ),
                    "SPOOL_DATABASE_URL": url.set(database=building).render_as_string(False),
                }
                out = subprocess.run(
                    [*SPOOL, "migrate"], env=with_url, capture_output=True, text=True, timeout=300, cwd=ROOT
                )
                if out.returncode != 0:
                    raise RuntimeError(f"spool migrate failed: {out.stderr[-2000:]}")
                if exists(template):  # another process published it meanwhile
                    conn.execute(text(f'DROP DATABASE "{building}" WITH (FORCE)'))
                else:
                    conn.execute(text(f'ALTER DATABASE "{building}" RENAME TO "{template}"'))
                    stale = conn.scalars(
                        text("SELECT datname FROM pg_database WHERE datname LIKE 'spool\\_tpl\\_%' AND datname <> :t"),
                        {"t": template},
                    ).all()
                    for name in stale:
                        if "_" not in name.removeprefix("spool_tpl_"):  # another process's build: not ours
                            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{url.database}" TEMPLATE "{template}"'))
    finally:
        admin.dispose()


def seed_tenants(db_url: str) -> dict[str, str]:
    """Tenants alpha, beta and ops with a user key each, and an admin key of ops, made in process by
    the tenancy service (what `spool tenant create` and `spool key create` run). Returns the keys."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from core.tenancy import service as tenancy

    engine = create_engine(db_url)
    sessions = sessionmaker(engine)
    keys: dict[str, str] = {}
    try:
        for name in ("alpha", "beta", "ops"):
            tenancy.run(sessions, tenancy.create_tenant, tenancy.TenantCreate(name=name))
            keys[name] = tenancy.run(sessions, tenancy.create_key, name, tenancy.KeyCreate())[0]
        keys["admin"] = tenancy.run(sessions, tenancy.create_key, "ops", tenancy.KeyCreate(scope="admin"))[0]
    finally:
        engine.dispose()
    return keys


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
    refuse_defaults(db_url, redis_url)  # both are dropped and flushed next
    redis_lib.Redis.from_url(redis_url).flushdb()
    st = Stack(env=env, logdir=logdir, port=port, root=root)
    if root == ROOT:
        migrated_database(db_url, env)
        st.keys.update(seed_tenants(db_url))
    else:  # another checkout (a benchmark's "before"): its own CLI, its own schema
        drop_database(db_url)
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


if __name__ == "__main__":
    # `python -m ops.harness shards N` (ops/test.sh): the wallclock shard, then the shards of N pytest-xdist
    # workers, on one line; a count this Redis server cannot serve is refused with the reason (exit 2).
    if sys.argv[1:2] != ["shards"] or len(sys.argv) != 3:
        sys.exit("usage: python -m ops.harness shards N")
    try:
        if not sys.argv[2].isdigit():
            raise ShardError("a whole number of shards")
        shards = xdist_shards(int(sys.argv[2]), redis_databases(TEST_REDIS))
    except ShardError as e:
        print(f"SPOOL_TEST_SHARDS={sys.argv[2]}: {e}", file=sys.stderr)
        sys.exit(2)
    print(WALLCLOCK_SHARD, *shards)
