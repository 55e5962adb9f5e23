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
