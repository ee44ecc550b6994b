"""Metering of prompt tokens the sampler's prefix cache held: their own column, priced at
their own rate (treadle.server.tenancy.metering).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "requests",
        sa.Column("cached_prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("requests", "cached_prompt_tokens")
