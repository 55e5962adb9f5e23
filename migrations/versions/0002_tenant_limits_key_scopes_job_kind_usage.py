"""tenant limits, key scopes, job kind, usage

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 21:20:01.346237
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('usage_daily',
    sa.Column('day', sa.Date(), nullable=False),
    sa.Column('tenant_id', sa.BigInteger(), nullable=False),
    sa.Column('key_id', sa.BigInteger(), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('requests', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('failed', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('gpu_seconds', sa.Float(), server_default='0', nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('day', 'tenant_id', 'key_id', 'model')
    )
    op.add_column('api_keys', sa.Column('scope', sa.String(length=16), server_default='user', nullable=False))
    op.add_column('api_keys', sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('api_keys', sa.Column('rpm', sa.Integer(), nullable=True))
    op.add_column('api_keys', sa.Column('tpm', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('key_id', sa.BigInteger(), nullable=True))
    op.add_column('jobs', sa.Column('kind', sa.String(length=16), server_default='interactive', nullable=False))
    op.add_column('jobs', sa.Column('reserved_tokens', sa.Integer(), server_default='0', nullable=False))
    op.create_check_constraint('ck_jobs_kind', 'jobs', "kind IN ('interactive', 'batch')")
    op.create_index('ix_jobs_queue', 'jobs', ['model', 'state', 'tenant_id', 'kind', 'priority', 'created_at'], unique=False)
    op.add_column('tenants', sa.Column('weight', sa.Integer(), server_default='1', nullable=False))
    op.add_column('tenants', sa.Column('rpm', sa.Integer(), nullable=True))
    op.add_column('tenants', sa.Column('tpm', sa.Integer(), nullable=True))
    op.add_column('tenants', sa.Column('tpd', sa.BigInteger(), nullable=True))
    op.add_column('tenants', sa.Column('max_concurrent', sa.Integer(), nullable=True))
    op.add_column('tenants', sa.Column('max_queued', sa.Integer(), nullable=True))


def downgrade() -> None:
    for column in ('max_queued', 'max_concurrent', 'tpd', 'tpm', 'rpm', 'weight'):
        op.drop_column('tenants', column)
    op.drop_index('ix_jobs_queue', table_name='jobs')
    op.drop_constraint('ck_jobs_kind', 'jobs', type_='check')
    for column in ('reserved_tokens', 'kind', 'key_id'):
        op.drop_column('jobs', column)
    for column in ('tpm', 'rpm', 'expires_at', 'scope'):
        op.drop_column('api_keys', column)
    op.drop_table('usage_daily')
