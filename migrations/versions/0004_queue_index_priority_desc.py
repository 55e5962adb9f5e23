"""queue index: priority descending, so each tenant's next jobs are an index range scan

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 22:35:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index('ix_jobs_queue', table_name='jobs')
    op.create_index('ix_jobs_queue', 'jobs', ['model', 'state', 'tenant_id', 'kind', sa.text('priority DESC'), 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_jobs_queue', table_name='jobs')
    op.create_index('ix_jobs_queue', 'jobs', ['model', 'state', 'tenant_id', 'kind', 'priority', 'created_at'])
