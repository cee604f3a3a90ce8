"""Initial schema: files, batches, batch_results.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _ts(name: str) -> sa.Column:
    return sa.Column(name, sa.Integer(), nullable=True)


def _count(name: str) -> sa.Column:
    return sa.Column(name, sa.Integer(), server_default="0", nullable=False)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("project", sa.String(), nullable=False),
        sa.Column("filename", sa.String(), nullable=False),
        sa.Column("purpose", sa.String(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(), server_default="processed", nullable=False),
    )
    op.create_index("ix_files_project_created", "files", ["project", "created_at", "id"])

    op.create_table(
        "batches",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("project", sa.String(), nullable=False),
        sa.Column("endpoint", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=True),
        sa.Column("input_file_id", sa.String(), nullable=False),
        sa.Column("completion_window", sa.String(), nullable=False),
        sa.Column("status", sa.String(), server_default="validating", nullable=False),
        sa.Column("output_file_id", sa.String(), nullable=True),
        sa.Column("error_file_id", sa.String(), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        _ts("in_progress_at"),
        _ts("expires_at"),
        _ts("finalizing_at"),
        _ts("completed_at"),
        _ts("failed_at"),
        _ts("expired_at"),
        _ts("cancelling_at"),
        _ts("cancelled_at"),
        _count("total"),
        _count("completed"),
        _count("failed"),
        sa.Column("metadata_", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        _count("input_tokens"),
        _count("cached_tokens"),
        _count("output_tokens"),
        sa.Column("output_expires_after", sa.JSON(), nullable=True),
        sa.Column("worker_id", sa.String(), nullable=True),
        sa.Column("heartbeat_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_batches_project_created", "batches", ["project", "created_at", "id"])
    op.create_index("ix_batches_status", "batches", ["status"])

    op.create_table(
        "batch_results",
        sa.Column("batch_id", sa.String(), nullable=False),
        sa.Column("custom_id", sa.String(), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("record", sa.Text(), nullable=False),
        _count("input_tokens"),
        _count("cached_tokens"),
        _count("output_tokens"),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "custom_id"),
    )


def downgrade() -> None:
    op.drop_table("batch_results")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_project_created", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_files_project_created", table_name="files")
    op.drop_table("files")
