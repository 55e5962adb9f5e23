"""jobs: each response's chain size (links, stored input bytes), so a chain is bounded from one row

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Why: `POST /v1/responses` with `previous_response_id` expands the whole chain (every link's input,
# templated and tokenized again). Its size must be known before any link is read, so each response
# row carries its chain's: `chain_links` (responses in the chain, itself included) and `chain_bytes`
# (their stored input items' JSON bytes). A trigger writes them as the row is inserted, from the
# previous response's row (one primary-key lookup), whatever path inserts it (the API's INSERT, a
# batch's COPY). A link's bytes count whatever became of it: a link cancelled while queued, billed
# nothing, still costs its chain what it stores. Rows of other jobs keep 0 and 0.
FUNCTION = """
CREATE OR REPLACE FUNCTION spool_response_chain() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    prev text := NEW.chat->'response'->>'previous_response_id';
    links integer;
    bytes bigint;
BEGIN
    NEW.chain_links := 1;
    NEW.chain_bytes := octet_length(coalesce(NEW.chat->'response'->'input', '[]'::jsonb)::text);
    IF prev IS NOT NULL AND left(prev, 5) = 'resp_' THEN
        SELECT p.chain_links, p.chain_bytes INTO links, bytes
        FROM jobs p WHERE p.id = 'cmpl-' || substr(prev, 6) AND p.tenant_id = NEW.tenant_id;
        NEW.chain_links := NEW.chain_links + coalesce(links, 0);
        NEW.chain_bytes := NEW.chain_bytes + coalesce(bytes, 0);
    END IF;
    RETURN NEW;
END $$;
"""

TRIGGER = """
CREATE TRIGGER jobs_response_chain BEFORE INSERT ON jobs
FOR EACH ROW WHEN ((NEW.chat -> 'response') IS NOT NULL) EXECUTE FUNCTION spool_response_chain();
"""

# The responses stored before this revision, root first (a link is always older than what it chains).
BACKFILL = """
WITH RECURSIVE chain AS (
    SELECT j.id, j.tenant_id, 1 AS links,
           octet_length(coalesce(j.chat->'response'->'input', '[]'::jsonb)::text)::bigint AS bytes
    FROM jobs j
    WHERE j.chat->'response' IS NOT NULL AND j.chat->'response'->>'previous_response_id' IS NULL
  UNION ALL
    SELECT j.id, j.tenant_id, c.links + 1,
           c.bytes + octet_length(coalesce(j.chat->'response'->'input', '[]'::jsonb)::text)
    FROM chain c
    JOIN jobs j ON j.tenant_id = c.tenant_id
     AND j.chat->'response'->>'previous_response_id' = 'resp_' || substr(c.id, 6)
)
UPDATE jobs SET chain_links = chain.links, chain_bytes = chain.bytes FROM chain WHERE jobs.id = chain.id
"""


def upgrade() -> None:
    op.add_column("jobs", sa.Column("chain_links", sa.Integer(), server_default="0", nullable=False))
    op.add_column("jobs", sa.Column("chain_bytes", sa.BigInteger(), server_default="0", nullable=False))
    op.execute(BACKFILL)
    op.execute(FUNCTION)
    op.execute(TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS jobs_response_chain ON jobs")
    op.execute("DROP FUNCTION IF EXISTS spool_response_chain()")
    op.drop_column("jobs", "chain_bytes")
    op.drop_column("jobs", "chain_links")
