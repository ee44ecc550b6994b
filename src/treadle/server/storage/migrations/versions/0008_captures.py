"""Capture sessions: completions served under one, recorded token-exactly, and the rewards
attached to their trajectories (treadle.server.core.captures).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    when = sa.DateTime(timezone=True)
    op.create_table(
        "captures",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("capture_id", sa.String(128), primary_key=True),
        sa.Column("created_at", when, nullable=False),
    )
    op.create_table(
        "captured_completions",
        sa.Column("completion_id", sa.String(96), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("capture_id", sa.String(128), nullable=False),
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("sampler_version", sa.String(512), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=True),
        sa.Column("sequence_id", sa.String(96), nullable=True),
        sa.Column("prompt", sa.LargeBinary, nullable=False),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("created_at", when, nullable=False),
        sa.Index("ix_captured_completions_capture", "tenant_id", "capture_id"),
    )
    op.create_table(
        "capture_rewards",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("capture_id", sa.String(128), primary_key=True),
        sa.Column("trajectory_id", sa.String(128), primary_key=True),
        sa.Column("reward", sa.Float, nullable=False),
        sa.Column("group_id", sa.String(128), nullable=True),
        sa.Column("created_at", when, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("capture_rewards")
    op.drop_table("captured_completions")
    op.drop_table("captures")
