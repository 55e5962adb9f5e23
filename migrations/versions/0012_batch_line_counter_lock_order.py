"""jobs: the batch line counters' trigger fires BEFORE the line's update, not after the statement

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 11:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Why: a worker ends and bills a line in one statement (core/tenancy/usage.billed_with: the ending,
# then the day's usage row in a CTE). An AFTER trigger runs at the end of that statement, so the
# worker took the usage row first and the batch row last, while the batch keeper takes the batch row
# first (FOR UPDATE), then counts the lines it cancels or expires in the usage row: a deadlock each
# time both met, and a cancelled batch whose lines kept ending was never finalized. A BEFORE ROW
# trigger updates the batch row as the line's row is locked, before the CTE's usage upsert: every
# writer now takes the batch row before the usage row. Row-level BEFORE triggers fire after the row
# is locked and re-checked (a line another transaction ended meanwhile is skipped and not counted),
# so each line is still counted once. It must return NEW: NULL would skip the line's update.
def _function(returns: str) -> str:
    """0011's counting function, ending with `RETURN {returns}` (NEW for BEFORE, NULL for AFTER)."""
    return f"""
CREATE OR REPLACE FUNCTION spool_batch_line_ended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    last boolean;
BEGIN
    UPDATE batches SET
        lines_completed = lines_completed + (NEW.state = 'succeeded')::int,
        lines_failed = lines_failed + (NEW.state <> 'succeeded')::int
    WHERE id = NEW.batch_id
    RETURNING lines_completed + lines_failed >= coalesce((request_counts->>'total')::bigint, 0) INTO last;
    IF last THEN
        PERFORM pg_notify('spool_batch_lines_ended', NEW.batch_id);
    END IF;
    RETURN {returns};
END $$
"""


WHEN = (
    "WHEN (NEW.batch_id IS NOT NULL AND OLD.state IN ('queued', 'dispatched', 'running')"
    " AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired'))"
)


def _trigger(when: str) -> str:
    return (
        f"CREATE TRIGGER jobs_batch_line_ended {when} UPDATE OF state ON jobs FOR EACH ROW {WHEN} "
        "EXECUTE FUNCTION spool_batch_line_ended()"
    )


def upgrade() -> None:
    # One transaction (alembic's): DROP and CREATE lock jobs against writes until the commit, so no
    # line ends uncounted in between.
    op.execute("DROP TRIGGER jobs_batch_line_ended ON jobs")
    op.execute(_function("NEW"))
    op.execute(_trigger("BEFORE"))


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_batch_line_ended ON jobs")
    op.execute(_function("NULL"))
    op.execute(_trigger("AFTER"))
