"""The quick start on a Postgres that refuses password-less TCP logins, as a new Debian cluster
does: ops/services.sh makes a login, writes it to .env, and Spool migrates and serves with it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from ops.harness import side_redis
from tests.conftest import ROOT, free_port, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("pg_createcluster") is None or os.geteuid() != 0, reason="needs Debian's postgresql-common, as root"
)


@pytest.fixture
def debian_cluster():
    version = sorted(os.listdir("/etc/postgresql"), key=lambda v: [int(x) for x in v.split(".")])[-1]
    name, port = f"fresh{uuid.uuid4().hex[:6]}", free_port()
    subprocess.run(["pg_createcluster", version, name, "--port", str(port), "--start"], check=True, capture_output=True)
    try:
        yield port
    finally:
        subprocess.run(["pg_dropcluster", "--stop", version, name], capture_output=True)


def test_services_make_a_login_and_spool_serves_with_it(debian_cluster, tmp_path):
    port = debian_cluster
    refused = subprocess.run(
        ["psql", f"postgresql://postgres@127.0.0.1:{port}/postgres", "-w", "-c", "SELECT 1"], capture_output=True
    )
    assert refused.returncode != 0, "the new cluster should refuse password-less TCP logins"

    env_file = tmp_path / ".env"
    env = {k: v for k, v in os.environ.items() if k != "SPOOL_DATABASE_URL"}
    setup = subprocess.run(
        ["bash", "ops/services.sh"],
        cwd=ROOT,
        env={**env, "SPOOL_PG_PORT": str(port), "SPOOL_ENV_FILE": str(env_file)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert setup.returncode == 0, setup.stderr
    url = next(line.split("=", 1)[1] for line in env_file.read_text().splitlines() if line.startswith("SPOOL_"))
    assert url.startswith("postgresql+psycopg://spool:") and f":{port}/spool" in url
    assert oct(env_file.stat().st_mode)[-3:] == "600"  # a password lives there

    api_port = free_port()
    run_env = {
        **env,
        "SPOOL_DATABASE_URL": url,
        "SPOOL_API_PORT": str(api_port),
        "SPOOL_REDIS_URL": side_redis("fresh_machine"),
    }
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "core.cli", "up"], cwd=ROOT, env=run_env, stdout=log, stderr=log, start_new_session=True
    )
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{api_port}/ready", timeout=3).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 120, "spool up to be ready")
        out = Path(tmp_path / "up.log").read_text()
        assert "API key for tenant 'default'" in out and "Spool is starting" in out
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(30)
