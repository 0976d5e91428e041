"""A rollout's reward is its run's: the run's scorers, at their weights (``run_scorers``).

Before this revision the store summed every score recorded for a rollout, so a custom
scorer outside the run's ``scorers`` changed the trace API's reward but not the trainer's.
The new table mirrors each run's ``RunState.scorers`` (the recorder writes it as runs
change); runs without rows keep the old rule. An errored rollout has no reward now (the
trainer never trains on it, ``flywheel eval`` gives it none): its reward is cleared here.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-14
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_scorers",
        sa.Column("run", sa.String(), primary_key=True),
        sa.Column("scorer", sa.String(), primary_key=True),
        sa.Column("weight", sa.Float(), nullable=False),
    )
    op.execute("UPDATE rollouts SET reward = NULL WHERE status = 'error'")


def downgrade() -> None:
    op.drop_table("run_scorers")
