"""batches: the line that ends a batch's last live line says so (NOTIFY), so it is finalized at once

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 01:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The channel core/batches/progress.py listens on (LINES_ENDED there).
CHANNEL = "spool_batch_lines_ended"

# As 0010's, plus: when the counts reach the batch's total, NOTIFY the batch keeper (delivered when
# the ending commits; several in one transaction are folded into one). A keeper that misses it (not
# listening, Postgres restarted) finds the batch at its next timed pass, as before.
FUNCTION = f"""
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
        PERFORM pg_notify('{CHANNEL}', NEW.batch_id);
    END IF;
    RETURN NULL;
END $$
"""

BEFORE = """
CREATE OR REPLACE FUNCTION spool_batch_line_ended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE batches SET
        lines_completed = lines_completed + (NEW.state = 'succeeded')::int,
        lines_failed = lines_failed + (NEW.state <> 'succeeded')::int
    WHERE id = NEW.batch_id;
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    op.execute(FUNCTION)


def downgrade() -> None:
    op.execute(BEFORE)
