"""Shared fixtures: a real Spool stack (api + worker + dispatcher processes) on the real Postgres and
Redis of this machine, with the real SmolLM2 model. Nothing of ours is mocked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import create_engine, text

from ops.harness import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
SPOOL = [sys.executable, "-m", "core.cli"]


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
MODEL = "smollm2-135m-instruct"


@dataclass
class Stack:
    env: dict[str, str]
    logdir: Path
    port: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    _worker_n: int = 0
    worker_name: str = ""
    metrics_ports: dict[str, int] = field(default_factory=dict)  # process name -> its /metrics port
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # process name -> its env overrides

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> str:
        out = subprocess.run([*SPOOL, *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"spool {' '.join(args)} failed: {out.stderr[-2000:]}"
        return out.stdout.strip()

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        # A process restarted under the same name (a test killed it) gets the same overrides again.
        if env is not None:
            self.envs[name] = env
        env = self.envs.get(name, {})
        log = open(self.logdir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [*SPOOL, *args], env={**self.env, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def start_worker(self) -> subprocess.Popen:
        self._worker_n += 1
        name = f"worker{self._worker_n}"
        self.metrics_ports["worker"] = free_port()
        proc = self.start(name, "worker", env={"SPOOL_METRICS_PORT": str(self.metrics_ports["worker"])})
        wait_for(lambda: "ready." in self.log(name) or proc.poll() is not None, 120, f"{name} ready")
        assert proc.poll() is None, self.log(name)[-3000:]
        self.procs["worker"] = proc
        self.worker_name = name
        return proc

    def kill_worker(self) -> None:
        proc = self.procs.pop("worker")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=120)

    def new_tenant(self, name: str, **limits) -> str:
        """Create a tenant through /admin and return a fresh user key for it."""
        with self.http(self.keys["admin"]) as admin:
            r = admin.post("/admin/tenants", json={"name": name, **limits})
            assert r.status_code == 201, r.text
            r = admin.post(f"/admin/tenants/{name}/keys", json={"name": "test"})
            assert r.status_code == 201, r.text
            return r.json()["key"]

    def openai(self, tenant: str = "alpha"):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.keys[tenant], max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def db_url() -> str:
    return TEST_DB


@contextmanager
def running_stack(
    logdir: Path, db_url: str, redis_url: str, extra_workers: tuple[dict[str, str], ...] = (), **extra_env: str
) -> Iterator[Stack]:
    """A whole Spool (api + dispatcher + one worker) on its own database and Redis db, with tenants
    alpha, beta and ops and an admin key, all made fresh."""
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
    st = Stack(env=env, logdir=logdir, port=port)
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

            def ready(n: str = name) -> bool:  # a lambda with a default argument: mypy cannot type it
                return "ready." in st.log(n)

            wait_for(ready, 120, f"{name} ready")

        def healthy() -> bool:
            try:
                return httpx.get(st.base_url + "/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 60, "api health")
        yield st
    finally:
        st.stop_all()
        print(f"\nprocess logs in {logdir}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("logs"), TEST_DB, TEST_REDIS) as st:
        yield st


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
