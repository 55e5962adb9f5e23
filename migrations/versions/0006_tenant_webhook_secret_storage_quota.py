"""per-tenant webhook secrets (Standard Webhooks `whsec_` keys) and storage quotas

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 15:20:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('tenants', sa.Column('webhook_secret', sa.String(length=64), nullable=True))
    op.add_column('tenants', sa.Column('max_storage_bytes', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column('tenants', 'max_storage_bytes')
    op.drop_column('tenants', 'webhook_secret')
