"""The schema changes only through Alembic, and the models match the migrations."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect
from sqlalchemy.engine import make_url

from core.cli.main import alembic_config
from core.infra.dbadmin import drop_database, ensure_database
from core.infra.orm import Base
from tests.conftest import TEST_DB

SCRATCH = make_url(TEST_DB).set(database="spool_migrations_test").render_as_string(hide_password=False)


def test_upgrade_downgrade_upgrade_and_no_drift(monkeypatch):
    monkeypatch.setenv("SPOOL_DATABASE_URL", SCRATCH)
    from core.config import get_settings

    get_settings.cache_clear()
    drop_database(SCRATCH)
    ensure_database(SCRATCH)
    engine = create_engine(SCRATCH)
    try:
        cfg = alembic_config()
        cfg.attributes["configure_logger"] = False
        command.upgrade(cfg, "head")
        assert {"tenants", "api_keys", "jobs"} <= set(inspect(engine).get_table_names())
        command.downgrade(cfg, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        command.upgrade(cfg, "head")
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
    finally:
        engine.dispose()
        get_settings.cache_clear()
        drop_database(SCRATCH)


def test_spool_init_migrates_and_prints_a_first_admin_key_once():
    """What compose's `migrate` service runs on a fresh database."""
    import os
    import subprocess

    from sqlalchemy import text

    from tests.conftest import ROOT, SPOOL

    url = make_url(TEST_DB).set(database="spool_init_test").render_as_string(hide_password=False)
    drop_database(url)
    env = {**os.environ, "SPOOL_DATABASE_URL": url}
    try:
        first = subprocess.run([*SPOOL, "init"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr[-2000:]
        key = first.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
        assert key.startswith("sk-spool-")
        again = subprocess.run([*SPOOL, "init"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "sk-spool-" not in again.stdout  # shown once
        engine = create_engine(url)
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT k.scope, t.name FROM api_keys k JOIN tenants t ON t.id = k.tenant_id")
            ).all()
        engine.dispose()
        assert [tuple(r) for r in rows] == [("admin", "admin")]
    finally:
        drop_database(url)
