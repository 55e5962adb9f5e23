"""jobs.result as JSON rather than JSONB: generated or echoed text may hold a NUL character, which
JSONB cannot store; JSON keeps the text exactly as written

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25 16:00:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column(
        'jobs',
        'result',
        type_=postgresql.JSON(astext_type=sa.Text()),
        existing_type=postgresql.JSONB(astext_type=sa.Text()),
        postgresql_using='result::json',
    )


def downgrade() -> None:
    # JSONB cannot hold a NUL: results that have one get U+FFFD in its place (lossy, like JSONB itself).
    op.alter_column(
        'jobs',
        'result',
        type_=postgresql.JSONB(astext_type=sa.Text()),
        existing_type=postgresql.JSON(astext_type=sa.Text()),
        postgresql_using=r"replace(result::text, '\u0000', '\ufffd')::jsonb",
    )
