"""jobs and batches: the bytes each row stores, and each tenant's running total; tenants' quotas on them

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Why (issue 49): a job's request (params, prompts, a chat's messages, a response's input items,
# instructions and tools) and its result are kept 30 days, up to ~8 MiB a request, counted against
# nothing. Each row now carries `stored_bytes`, written by triggers whatever path writes it (the API's
# INSERT, a batch's INSERT ... SELECT, an ending's UPDATE, a deleted response's), and each tenant's
# total is kept in `tenant_stored` by the same statements, so admission reads a handful of rows
# instead of summing a million.
#
# A size is the value's JSON text in bytes (`octet_length(v::text)`): what the client sent and reads
# back, what the API can count before storing (core/tenancy/quota.json_bytes writes the same text), and
# what retention frees. Not jsonb's binary form (a token id takes 13 bytes there, 4 or 5 as text) nor
# pglz's (a client cannot predict it). A `json` value's is read from its TOAST header, unread; a
# `jsonb` value is written out once, as the row is inserted (a few ms a megabyte, beside its parse).
#
# The total is split into SLOTS rows per tenant, each backend adding to its own slot
# (pg_backend_pid() % SLOTS): jobs of one tenant inserted or ended at once by different connections
# mostly lock different rows, not one hot row until commit. INSERT and DELETE add once per statement
# (a batch's 50k lines, retention's slice: one upsert per tenant, in tenant order), an UPDATE once per
# row whose size changed (an ending). No foreign key: a tenant's cascade delete removes its jobs, whose
# trigger must still be able to write its row.
SLOTS = 16

FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION spool_jsonb_bytes(v jsonb) RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(octet_length(v::text), 0)::bigint
$$;

CREATE OR REPLACE FUNCTION spool_json_bytes(v json) RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(octet_length(v::text), 0)::bigint
$$;

CREATE OR REPLACE FUNCTION spool_job_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.stored_bytes := spool_jsonb_bytes(NEW.params) + spool_jsonb_bytes(NEW.prompts)
        + spool_jsonb_bytes(NEW.chat) + spool_json_bytes(NEW.result)
        + spool_jsonb_bytes(NEW.usage) + spool_jsonb_bytes(NEW.error);
    RETURN NEW;
END $$;

-- An ending (or a rewritten result): the change of what it wrote, never the input read again.
CREATE OR REPLACE FUNCTION spool_job_output_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.stored_bytes := NEW.stored_bytes
        + spool_json_bytes(NEW.result) - spool_json_bytes(OLD.result)
        + spool_jsonb_bytes(NEW.usage) - spool_jsonb_bytes(OLD.usage)
        + spool_jsonb_bytes(NEW.error) - spool_jsonb_bytes(OLD.error);
    RETURN NEW;
END $$;

-- A deleted response drops its input items: the bytes go with them.
CREATE OR REPLACE FUNCTION spool_job_chat_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.stored_bytes := NEW.stored_bytes + spool_jsonb_bytes(NEW.chat) - spool_jsonb_bytes(OLD.chat);
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION spool_batch_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.stored_bytes := spool_jsonb_bytes(NEW.metadata) + spool_jsonb_bytes(NEW.errors)
        + spool_jsonb_bytes(NEW.webhook_state) + spool_jsonb_bytes(NEW.request_counts)
        + octet_length(coalesce(NEW.webhook_url, ''));
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION spool_stored_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO tenant_stored AS s (tenant_id, slot, bytes)
    SELECT tenant_id, pg_backend_pid() % {SLOTS},
           CASE WHEN TG_OP = 'DELETE' THEN -sum(stored_bytes) ELSE sum(stored_bytes) END
    FROM changed GROUP BY tenant_id HAVING sum(stored_bytes) <> 0 ORDER BY tenant_id
    ON CONFLICT (tenant_id, slot) DO UPDATE SET bytes = s.bytes + excluded.bytes;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION spool_stored_row_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO tenant_stored AS s (tenant_id, slot, bytes)
    VALUES (NEW.tenant_id, pg_backend_pid() % {SLOTS}, NEW.stored_bytes - OLD.stored_bytes)
    ON CONFLICT (tenant_id, slot) DO UPDATE SET bytes = s.bytes + excluded.bytes;
    RETURN NULL;
END $$;
"""

TRIGGERS = """
CREATE TRIGGER jobs_stored_bytes BEFORE INSERT ON jobs FOR EACH ROW EXECUTE FUNCTION spool_job_bytes();
CREATE TRIGGER jobs_stored_output BEFORE UPDATE OF result, usage, error ON jobs
    FOR EACH ROW EXECUTE FUNCTION spool_job_output_bytes();
CREATE TRIGGER jobs_stored_chat BEFORE UPDATE OF chat ON jobs FOR EACH ROW EXECUTE FUNCTION spool_job_chat_bytes();
CREATE TRIGGER jobs_stored_insert AFTER INSERT ON jobs REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION spool_stored_rows();
CREATE TRIGGER jobs_stored_delete AFTER DELETE ON jobs REFERENCING OLD TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION spool_stored_rows();
CREATE TRIGGER jobs_stored_update AFTER UPDATE ON jobs FOR EACH ROW
    WHEN (OLD.stored_bytes IS DISTINCT FROM NEW.stored_bytes) EXECUTE FUNCTION spool_stored_row_update();

CREATE TRIGGER batches_stored_bytes BEFORE INSERT OR UPDATE OF metadata, errors, webhook_state, request_counts,
    webhook_url ON batches FOR EACH ROW EXECUTE FUNCTION spool_batch_bytes();
CREATE TRIGGER batches_stored_insert AFTER INSERT ON batches REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION spool_stored_rows();
CREATE TRIGGER batches_stored_delete AFTER DELETE ON batches REFERENCING OLD TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION spool_stored_rows();
CREATE TRIGGER batches_stored_update AFTER UPDATE ON batches FOR EACH ROW
    WHEN (OLD.stored_bytes IS DISTINCT FROM NEW.stored_bytes) EXECUTE FUNCTION spool_stored_row_update();
"""

# What is stored already: sized once (a rewrite of every row, once), then summed per tenant.
BACKFILL = """
UPDATE jobs SET stored_bytes = spool_jsonb_bytes(params) + spool_jsonb_bytes(prompts) + spool_jsonb_bytes(chat)
    + spool_json_bytes(result) + spool_jsonb_bytes(usage) + spool_jsonb_bytes(error);
UPDATE batches SET stored_bytes = spool_jsonb_bytes(metadata) + spool_jsonb_bytes(errors)
    + spool_jsonb_bytes(webhook_state) + spool_jsonb_bytes(request_counts) + octet_length(coalesce(webhook_url, ''));
INSERT INTO tenant_stored (tenant_id, slot, bytes)
SELECT tenant_id, 0, sum(b) FROM (
    SELECT tenant_id, stored_bytes AS b FROM jobs UNION ALL SELECT tenant_id, stored_bytes FROM batches
) rows GROUP BY tenant_id;
"""

DROP = """
DROP TRIGGER IF EXISTS batches_stored_update ON batches;
DROP TRIGGER IF EXISTS batches_stored_delete ON batches;
DROP TRIGGER IF EXISTS batches_stored_insert ON batches;
DROP TRIGGER IF EXISTS batches_stored_bytes ON batches;
DROP TRIGGER IF EXISTS jobs_stored_update ON jobs;
DROP TRIGGER IF EXISTS jobs_stored_delete ON jobs;
DROP TRIGGER IF EXISTS jobs_stored_insert ON jobs;
DROP TRIGGER IF EXISTS jobs_stored_chat ON jobs;
DROP TRIGGER IF EXISTS jobs_stored_output ON jobs;
DROP TRIGGER IF EXISTS jobs_stored_bytes ON jobs;
DROP FUNCTION IF EXISTS spool_stored_row_update();
DROP FUNCTION IF EXISTS spool_stored_rows();
DROP FUNCTION IF EXISTS spool_batch_bytes();
DROP FUNCTION IF EXISTS spool_job_chat_bytes();
DROP FUNCTION IF EXISTS spool_job_output_bytes();
DROP FUNCTION IF EXISTS spool_job_bytes();
DROP FUNCTION IF EXISTS spool_json_bytes(json);
DROP FUNCTION IF EXISTS spool_jsonb_bytes(jsonb);
"""


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_stored_bytes", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("max_redis_bytes", sa.BigInteger(), nullable=True))
    op.add_column("jobs", sa.Column("stored_bytes", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("batches", sa.Column("stored_bytes", sa.BigInteger(), server_default="0", nullable=False))
    op.create_table(
        "tenant_stored",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("slot", sa.SmallInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "slot"),
    )
    op.execute(FUNCTIONS)
    op.execute(BACKFILL)
    op.execute(TRIGGERS)


def downgrade() -> None:
    op.execute(DROP)
    op.drop_table("tenant_stored")
    op.drop_column("batches", "stored_bytes")
    op.drop_column("jobs", "stored_bytes")
    op.drop_column("tenants", "max_redis_bytes")
    op.drop_column("tenants", "max_stored_bytes")
