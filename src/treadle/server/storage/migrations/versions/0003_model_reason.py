"""Why the server gave a model up (one it could not restore after a restart): kept with the
model, so that every later request, in any API process and after any restart, hears the
reason, and no later start tries that model's restore again.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("models", sa.Column("unloaded_reason", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:  # SQLite rebuilds the table
        batch.drop_column("unloaded_reason")
