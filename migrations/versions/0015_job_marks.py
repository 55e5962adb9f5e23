"""jobs.marks: where each stream entry of an ended job left its choice, kept on its row

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Why: a resume from a `Last-Event-ID` (and a Responses rejoin with `starting_after`) after the ended
# stream has expired is placed in the row's text by the marks of the stream's entries. They were kept
# in Redis (a day, then as long as the stream: 5 minutes); on the row they live as long as the job
# does and cost Redis nothing. Nullable, no default: existing rows keep NULL (a job that streamed
# nothing, or ended before this column, has none).


def upgrade() -> None:
    op.add_column("jobs", sa.Column("marks", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "marks")
