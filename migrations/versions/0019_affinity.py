"""Prefix affinity: jobs.affinity

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-29 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Why: a request's affinity key (core/jobs/affinity.py) is kept with its job, so that whoever sends it
# (the API at once, the dispatcher later, a re-send, the next attempt after a worker died) routes it to
# the same worker's prefix cache. A nullable column without a default: added without a table rewrite.


def upgrade() -> None:
    op.add_column("jobs", sa.Column("affinity", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "affinity")
