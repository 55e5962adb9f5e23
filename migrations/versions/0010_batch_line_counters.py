"""batches: line counters kept as lines end (a trigger on jobs), and a cursor for sliced result files

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = "('queued', 'dispatched', 'running')"
ENDED = "('succeeded', 'failed', 'cancelled', 'expired')"
FINAL_BATCH = "('completed', 'failed', 'expired', 'cancelled')"

# Row-level, with the WHEN evaluated before any function call: a job that is not a batch line, or an
# update that does not end one (claims, lease renewals), costs nothing. A line ends once (every
# ending is a compare-and-set from a live state), so each is counted once, in the transaction that
# ended it, whichever process or statement did.
FUNCTION = """
CREATE OR REPLACE FUNCTION spool_batch_line_ended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE batches SET
        lines_completed = lines_completed + (NEW.state = 'succeeded')::int,
        lines_failed = lines_failed + (NEW.state <> 'succeeded')::int
    WHERE id = NEW.batch_id;
    RETURN NULL;
END $$
"""
TRIGGER = f"""
CREATE TRIGGER jobs_batch_line_ended AFTER UPDATE OF state ON jobs FOR EACH ROW
WHEN (NEW.batch_id IS NOT NULL AND OLD.state IN {LIVE} AND NEW.state IN {ENDED})
EXECUTE FUNCTION spool_batch_line_ended()
"""


def upgrade() -> None:
    op.add_column("batches", sa.Column("lines_completed", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("batches", sa.Column("lines_failed", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("batches", sa.Column("results_line", sa.BigInteger(), nullable=True))
    op.execute(FUNCTION)
    # CREATE TRIGGER locks jobs against writes until this transaction commits: no line can end
    # between the trigger's creation and the counts below, so none is missed or counted twice.
    op.execute(TRIGGER)
    op.execute(
        "UPDATE batches SET lines_completed = coalesce((request_counts->>'completed')::bigint, 0), "
        f"lines_failed = coalesce((request_counts->>'failed')::bigint, 0) WHERE status IN {FINAL_BATCH}"
    )
    op.execute(
        "UPDATE batches b SET lines_completed = c.ok, lines_failed = c.bad FROM ("
        "SELECT batch_id, count(*) FILTER (WHERE state = 'succeeded') AS ok, "
        f"count(*) FILTER (WHERE state IN ('failed', 'cancelled', 'expired')) AS bad FROM jobs "
        f"WHERE batch_id IS NOT NULL GROUP BY batch_id) c WHERE b.id = c.batch_id AND b.status NOT IN {FINAL_BATCH}"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS jobs_batch_line_ended ON jobs")
    op.execute("DROP FUNCTION IF EXISTS spool_batch_line_ended()")
    op.execute(
        "UPDATE batches SET request_counts = jsonb_build_object('total', coalesce((request_counts->>'total')::bigint, 0), "
        "'completed', lines_completed, 'failed', lines_failed)"
    )
    op.drop_column("batches", "results_line")
    op.drop_column("batches", "lines_failed")
    op.drop_column("batches", "lines_completed")
