"""Service tiers: jobs.service_tier, tenants.allow_priority, usage per tier, queued requests by tier

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-29 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Why: OpenAI's `service_tier` gives a request its lane in the fair dispatcher (core/jobs/tiers.py), and
# the tier that served it is echoed, billed and counted. A column with a constant default is added
# without rewriting the table (Postgres >= 11), so existing jobs read `default` at once. The partial
# index holds only queued API requests: the dispatcher finds each tenant's heads of a tier, and a new
# request whether its model is contended, without walking a queued batch's million lines.


def upgrade() -> None:
    op.add_column("jobs", sa.Column("service_tier", sa.String(16), server_default="default", nullable=False))
    op.add_column("tenants", sa.Column("allow_priority", sa.Boolean(), server_default="false", nullable=False))
    op.create_index(
        "ix_jobs_queued_tier",
        "jobs",
        ["model", "service_tier", "tenant_id", sa.text("priority DESC"), "created_at"],
        postgresql_where=sa.text("state = 'queued' AND kind = 'interactive'"),
    )
    op.add_column("usage_daily", sa.Column("service_tier", sa.String(16), server_default="default", nullable=False))
    op.drop_constraint("usage_daily_pkey", "usage_daily", type_="primary")
    op.create_primary_key("usage_daily_pkey", "usage_daily", ["day", "tenant_id", "key_id", "model", "service_tier"])


def downgrade() -> None:
    # The tiers' rows of a day, tenant, key and model summed back into one.
    counts = ("requests", "failed", "prompt_tokens", "completion_tokens", "gpu_seconds")
    sums = ", ".join(f"sum({c}) AS {c}" for c in counts)
    op.execute(
        f"CREATE TEMP TABLE usage_merged ON COMMIT DROP AS SELECT day, tenant_id, key_id, model, {sums}"
        " FROM usage_daily GROUP BY day, tenant_id, key_id, model"
    )
    op.execute("DELETE FROM usage_daily")
    op.drop_constraint("usage_daily_pkey", "usage_daily", type_="primary")
    op.drop_column("usage_daily", "service_tier")
    op.execute("INSERT INTO usage_daily SELECT * FROM usage_merged")
    op.create_primary_key("usage_daily_pkey", "usage_daily", ["day", "tenant_id", "key_id", "model"])
    op.drop_index("ix_jobs_queued_tier", table_name="jobs")
    op.drop_column("tenants", "allow_priority")
    op.drop_column("jobs", "service_tier")
