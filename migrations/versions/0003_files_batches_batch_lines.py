"""files, batches, batch lines

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 21:33:00.638746
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('batches',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.BigInteger(), nullable=False),
    sa.Column('key_id', sa.BigInteger(), nullable=True),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('input_file_id', sa.String(length=40), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), server_default='validating', nullable=False),
    sa.Column('output_file_id', sa.String(length=40), nullable=True),
    sa.Column('error_file_id', sa.String(length=40), nullable=True),
    sa.Column('errors', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('request_counts', postgresql.JSONB(astext_type=sa.Text()), server_default='{"total": 0, "completed": 0, "failed": 0}', nullable=False),
    sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('webhook_url', sa.String(length=2048), nullable=True),
    sa.Column('webhook_state', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('in_progress_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finalizing_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelling_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_batches_status', 'batches', ['status'], unique=False)
    op.create_index('ix_batches_tenant_created', 'batches', ['tenant_id', 'created_at'], unique=False)
    op.create_table('files',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.BigInteger(), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('lines', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('status', sa.String(length=16), server_default='processed', nullable=False),
    sa.Column('deleted', sa.Boolean(), server_default='false', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_files_tenant_created', 'files', ['tenant_id', 'created_at'], unique=False)
    op.create_table('file_chunks',
    sa.Column('file_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.ForeignKeyConstraint(['file_id'], ['files.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('file_id', 'seq')
    )
    op.add_column('jobs', sa.Column('batch_id', sa.String(length=40), nullable=True))
    op.add_column('jobs', sa.Column('line_no', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('custom_id', sa.String(length=512), nullable=True))
    op.create_index('ix_jobs_batch_custom', 'jobs', ['batch_id', 'custom_id'], unique=True, postgresql_where=sa.text('batch_id IS NOT NULL'))
    op.create_index('ix_jobs_batch_line', 'jobs', ['batch_id', 'line_no'], unique=True, postgresql_where=sa.text('batch_id IS NOT NULL'))
    op.create_index('ix_jobs_batch_state', 'jobs', ['batch_id', 'state'], unique=False, postgresql_where=sa.text('batch_id IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_jobs_batch_state', table_name='jobs', postgresql_where=sa.text('batch_id IS NOT NULL'))
    op.drop_index('ix_jobs_batch_line', table_name='jobs', postgresql_where=sa.text('batch_id IS NOT NULL'))
    op.drop_index('ix_jobs_batch_custom', table_name='jobs', postgresql_where=sa.text('batch_id IS NOT NULL'))
    op.drop_column('jobs', 'custom_id')
    op.drop_column('jobs', 'line_no')
    op.drop_column('jobs', 'batch_id')
    op.drop_table('file_chunks')
    op.drop_index('ix_files_tenant_created', table_name='files')
    op.drop_table('files')
    op.drop_index('ix_batches_tenant_created', table_name='batches')
    op.drop_index('ix_batches_status', table_name='batches')
    op.drop_table('batches')
