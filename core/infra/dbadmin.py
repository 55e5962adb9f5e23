"""Creating the database itself (Alembic only manages what is inside it)."""

from __future__ import annotations

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url


def ensure_database(url: str) -> None:
    u = make_url(url)
    admin = create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": u.database}) is None:
            conn.execute(text(f'CREATE DATABASE "{u.database}"'))
    admin.dispose()


def drop_database(url: str) -> None:
    u = make_url(url)
    admin = create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{u.database}" WITH (FORCE)'))
    admin.dispose()
