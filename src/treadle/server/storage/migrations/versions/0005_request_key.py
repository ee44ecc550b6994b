"""The key a request was sent with, kept on its row: spend counting charges each operation
to its tenant and key from the row's own columns, whether or not the console records it
(its op_records were the only place the key was kept). Rows filed before take their key
from op_records.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("key_id", sa.String(32), nullable=True))
    op.execute(
        "UPDATE requests SET key_id = (SELECT o.key_id FROM op_records o "
        "WHERE o.request_id = requests.request_id) "
        "WHERE request_id IN (SELECT request_id FROM op_records WHERE key_id IS NOT NULL)"
    )


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:  # SQLite rebuilds the table
        batch.drop_column("key_id")
