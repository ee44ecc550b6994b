"""The rest of the Tinker SDK's surface: published checkpoints and their TTL (the row stays
when its files are deleted at expiry), a session's project, the clients that joined a
sampling session, the project a copied run was copied into, uploaded custom losses, and
external-weights uploads.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    when = sa.DateTime(timezone=True)
    op.add_column(
        "checkpoints", sa.Column("public", sa.Boolean, nullable=False, server_default=sa.false())
    )
    op.add_column("checkpoints", sa.Column("expires_at", when, nullable=True))
    op.add_column("checkpoints", sa.Column("expired_at", when, nullable=True))
    op.create_index("ix_checkpoints_expires_at", "checkpoints", ["expires_at"])
    op.add_column("sessions", sa.Column("project_id", sa.String(128), nullable=True))
    op.add_column("models", sa.Column("project_id", sa.String(128), nullable=True))
    op.create_index("ix_sessions_project_id", "sessions", ["project_id"])
    op.add_column(
        "sampling_sessions",
        sa.Column("clients", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "custom_losses",
        sa.Column("loss_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False, index=True),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("seq_id", sa.BigInteger, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("upload", sa.Text, nullable=False),
        sa.Column("created_at", when, nullable=False),
        sa.UniqueConstraint("session_id", "seq_id"),
    )
    op.create_table(
        "uploads",
        sa.Column("upload_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False, index=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("files", sa.JSON, nullable=False),
        sa.Column("received", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("tinker_path", sa.String(512), nullable=True),
        sa.Column("expires_at", when, nullable=False),
        sa.Column("created_at", when, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("uploads")
    op.drop_table("custom_losses")
    with op.batch_alter_table("sampling_sessions") as batch:  # SQLite rebuilds the table
        batch.drop_column("clients")
    with op.batch_alter_table("models") as batch:
        batch.drop_column("project_id")
    op.drop_index("ix_sessions_project_id", "sessions")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("project_id")
    op.drop_index("ix_checkpoints_expires_at", "checkpoints")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("expired_at")
        batch.drop_column("expires_at")
        batch.drop_column("public")
