"""Teachers' signals (``signals``): a teacher's logprobs of each rollout's sampled tokens, by
node, one row per teacher per rollout, as the SIGNALS stream carries them (without the top-k
lists a dense distillation term reads). The trace API gives them beside the token layer.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Types as they were at this revision (a migration never follows later model changes).
Json = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
UTCDateTime = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "signals",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("env", sa.String(), nullable=False),
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("values", Json, nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("rollout_id", "source", name="uq_signals_rollout_source"),
    )


def downgrade() -> None:
    op.drop_table("signals")
