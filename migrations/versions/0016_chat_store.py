"""jobs: a partial index for the tenant's stored chat completions (`store: true`)

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Why: `GET /v1/chat/completions` lists a tenant's stored chat completions in creation order. What a
# stored completion keeps (its messages and metadata) lives in the job's `chat` under `stored`
# (core/jobs/chat_store.py), where the stored-bytes triggers (0014) already count it, so no column is
# added; this index finds the tenant's stored ones, in order, without walking its other jobs. Partial:
# it holds only stored completions, so the API's inserts of every other job do not pay for it.
# Built CONCURRENTLY (outside the migration's transaction): a plain CREATE INDEX would hold every
# insert into `jobs` for the whole scan of the table.
NAME = "ix_jobs_chat_stored"
WHERE = "(chat -> 'stored') IS NOT NULL"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            NAME,
            "jobs",
            ["tenant_id", "created_at", "id"],
            postgresql_where=sa.text(WHERE),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(NAME, table_name="jobs", postgresql_concurrently=True)
