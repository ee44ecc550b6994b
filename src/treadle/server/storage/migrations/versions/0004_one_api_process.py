"""One API process per database: the tables through which several API processes shared one
PostgreSQL database (the models the engine host served, and control calls for it) go.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_table("control_calls")
    op.drop_table("served_models")


def downgrade() -> None:
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
