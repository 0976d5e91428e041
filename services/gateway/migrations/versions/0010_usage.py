"""Metering (``usage``): what each run used, one row per count (a rollout's model calls, a
trainer step, an API request, a sandbox), and which step trained each rollout (``trained_rollouts``).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Types as they were at this revision (a migration never follows later model changes).
UTCDateTime = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("tenant", sa.String(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("rollout_id", sa.String(), nullable=True),
        sa.Column("num_calls", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("sampled_tokens", sa.BigInteger(), nullable=False),
        sa.Column("trained_tokens", sa.BigInteger(), nullable=False),
        sa.Column("sft_tokens", sa.BigInteger(), nullable=False),
        sa.Column("sandbox_s", sa.Float(), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_usage_run_created_at", "usage", ["run", "created_at"])
    op.create_index("ix_usage_created_at", "usage", ["created_at"])
    op.create_table(
        "trained_rollouts",
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("rollout_id"),
    )
    op.create_index("ix_trained_rollouts_run", "trained_rollouts", ["run"])


def downgrade() -> None:
    op.drop_index("ix_trained_rollouts_run", table_name="trained_rollouts")
    op.drop_table("trained_rollouts")
    op.drop_index("ix_usage_created_at", table_name="usage")
    op.drop_index("ix_usage_run_created_at", table_name="usage")
    op.drop_table("usage")
