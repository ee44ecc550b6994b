"""Several API processes on one database: a session's last sign of life as any of them saw
it, the facts of the models the engine host serves, and control calls for that host.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "served_models",
        sa.Column("name", sa.String(256), primary_key=True),
        sa.Column("vocab_size", sa.BigInteger, nullable=False),
        sa.Column("max_seq_len", sa.BigInteger, nullable=False),
        sa.Column("max_lora_rank", sa.BigInteger, nullable=False),
        sa.Column("arch", sa.String(64), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "control_calls",
        sa.Column("call_id", sa.String(64), primary_key=True),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("args", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.JSON, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("control_calls")
    op.drop_table("served_models")
    with op.batch_alter_table("sessions") as batch:  # SQLite rebuilds the table
        batch.drop_column("last_seen_at")
