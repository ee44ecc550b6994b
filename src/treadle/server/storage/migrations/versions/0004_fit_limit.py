"""The longest sequence a served model's forward_backward fits in its engine's memory budget,
announced with its other facts, so that every API process refuses a longer one at its edge.

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
    op.add_column(
        "served_models",
        sa.Column("max_train_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    with op.batch_alter_table("served_models") as batch:  # SQLite rebuilds the table
        batch.drop_column("max_train_tokens")
