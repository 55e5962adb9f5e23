"""batches: `model`, `usage` totals kept as lines end, and `output_expires_after` for their result files

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENDED = "('succeeded', 'failed', 'cancelled', 'expired')"

# Why: OpenAI's batch object shows `usage` (input, cached input and output tokens over its requests).
# Summing a million lines' usage on every GET is a scan of the batch's lines each time; the totals are
# kept on the batch row instead, by the trigger that already counts lines as they end (0010-0012: one
# UPDATE of the batch row per line ending, taken before the usage row, in every writer's order), so a
# GET reads one row. A line's usage is what its row keeps: a success's in the ending's own UPDATE, a
# cancelled line's (what it had generated) written just after the ending, in the same transaction, by
# a second trigger that adds the change.

# A line's tokens of one kind, as its `usage` keeps them (core/generation/events.Usage; `cached_tokens`
# also under `prompt_tokens_details`, the older shape usage_of reads). NULL or not an object: 0.
PART = """
CREATE OR REPLACE FUNCTION spool_usage_part(u jsonb, part text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN jsonb_typeof(u) IS DISTINCT FROM 'object' THEN 0
    WHEN part = 'cached_tokens' THEN coalesce((u->'prompt_tokens_details'->>'cached_tokens')::bigint,
                                              (u->>'cached_tokens')::bigint, 0)
    ELSE coalesce((u->>part)::bigint, 0) END
$$
"""


def _ended(usage: bool) -> str:
    """0012's counting function (BEFORE ROW: `RETURN NEW`), with the line's usage added when `usage`."""
    add = (
        """,
        usage_prompt_tokens = usage_prompt_tokens + spool_usage_part(NEW.usage, 'prompt_tokens'),
        usage_cached_tokens = usage_cached_tokens + spool_usage_part(NEW.usage, 'cached_tokens'),
        usage_completion_tokens = usage_completion_tokens + spool_usage_part(NEW.usage, 'completion_tokens')"""
        if usage
        else ""
    )
    return f"""
CREATE OR REPLACE FUNCTION spool_batch_line_ended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    last boolean;
BEGIN
    UPDATE batches SET
        lines_completed = lines_completed + (NEW.state = 'succeeded')::int,
        lines_failed = lines_failed + (NEW.state <> 'succeeded')::int{add}
    WHERE id = NEW.batch_id
    RETURNING lines_completed + lines_failed >= coalesce((request_counts->>'total')::bigint, 0) INTO last;
    IF last THEN
        PERFORM pg_notify('spool_batch_lines_ended', NEW.batch_id);
    END IF;
    RETURN NEW;
END $$
"""


# An ended line whose usage is written after its ending (a cancel keeps what the line generated):
# the change is added. BEFORE ROW, as the ending's trigger, so the batch row is taken in the same order.
USAGE_LATER = """
CREATE OR REPLACE FUNCTION spool_batch_line_usage() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE batches SET
        usage_prompt_tokens = usage_prompt_tokens + spool_usage_part(NEW.usage, 'prompt_tokens')
            - spool_usage_part(OLD.usage, 'prompt_tokens'),
        usage_cached_tokens = usage_cached_tokens + spool_usage_part(NEW.usage, 'cached_tokens')
            - spool_usage_part(OLD.usage, 'cached_tokens'),
        usage_completion_tokens = usage_completion_tokens + spool_usage_part(NEW.usage, 'completion_tokens')
            - spool_usage_part(OLD.usage, 'completion_tokens')
    WHERE id = NEW.batch_id;
    RETURN NEW;
END $$
"""
USAGE_TRIGGER = f"""
CREATE TRIGGER jobs_batch_line_usage BEFORE UPDATE OF usage ON jobs FOR EACH ROW
WHEN (NEW.batch_id IS NOT NULL AND OLD.state IN {ENDED} AND NEW.state IN {ENDED}
      AND NEW.usage IS DISTINCT FROM OLD.usage)
EXECUTE FUNCTION spool_batch_line_usage()
"""

# What the lines that already ended used, and the models they name (in the order each first appears).
BACKFILL_USAGE = f"""
UPDATE batches b SET usage_prompt_tokens = s.p, usage_cached_tokens = s.c, usage_completion_tokens = s.o
FROM (SELECT batch_id, sum(spool_usage_part(usage, 'prompt_tokens')) AS p,
             sum(spool_usage_part(usage, 'cached_tokens')) AS c,
             sum(spool_usage_part(usage, 'completion_tokens')) AS o
      FROM jobs WHERE batch_id IS NOT NULL AND state IN {ENDED} GROUP BY batch_id) s
WHERE b.id = s.batch_id
"""
BACKFILL_MODEL = """
UPDATE batches b SET model = m.models
FROM (SELECT batch_id, string_agg(model, ',' ORDER BY first) AS models
      FROM (SELECT batch_id, model, min(line_no) AS first FROM jobs WHERE batch_id IS NOT NULL
            GROUP BY batch_id, model) per_model
      GROUP BY batch_id) m
WHERE b.id = m.batch_id
"""


def upgrade() -> None:
    op.add_column("batches", sa.Column("model", sa.Text(), nullable=True))
    for col in ("usage_prompt_tokens", "usage_cached_tokens", "usage_completion_tokens"):
        op.add_column("batches", sa.Column(col, sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("batches", sa.Column("output_expires_s", sa.Integer(), nullable=True))
    # Until this transaction (alembic's) commits no line may end: none is left out of the backfill
    # below or counted twice by the new function (CREATE OR REPLACE FUNCTION alone locks no table).
    op.execute("LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE")
    op.execute(PART)
    op.execute(_ended(usage=True))
    op.execute(USAGE_LATER)
    op.execute(USAGE_TRIGGER)
    op.execute(BACKFILL_USAGE)
    op.execute(BACKFILL_MODEL)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS jobs_batch_line_usage ON jobs")
    op.execute("DROP FUNCTION IF EXISTS spool_batch_line_usage()")
    op.execute(_ended(usage=False))
    op.execute("DROP FUNCTION IF EXISTS spool_usage_part(jsonb, text)")
    op.drop_column("batches", "output_expires_s")
    for col in ("usage_completion_tokens", "usage_cached_tokens", "usage_prompt_tokens"):
        op.drop_column("batches", col)
    op.drop_column("batches", "model")
