"""chat completions: how a chat job renders (NULL for text completions); request ids on jobs and batches

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 15:40:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('chat', postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column('jobs', sa.Column('request_id', sa.String(length=128), nullable=True))
    op.add_column('batches', sa.Column('request_id', sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column('batches', 'request_id')
    op.drop_column('jobs', 'request_id')
    op.drop_column('jobs', 'chat')
