"""idempotency keys: a renewable, fenced hold (lock_token, locked_until on the database's clock)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 16:30:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('idempotency_keys', sa.Column('lock_token', sa.String(length=32), nullable=True))
    op.add_column('idempotency_keys', sa.Column('locked_until', sa.DateTime(timezone=True), nullable=True))
    # Keys still in flight keep the hold they had: 60 s from when they were taken.
    op.execute(
        "UPDATE idempotency_keys SET locked_until = created_at + interval '60 seconds' WHERE object_id IS NULL"
    )


def downgrade() -> None:
    op.drop_column('idempotency_keys', 'locked_until')
    op.drop_column('idempotency_keys', 'lock_token')
