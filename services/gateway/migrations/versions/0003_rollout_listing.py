"""Rollout listing: indexes for a run's rollouts newest first; no reward where a scorer failed.

The listing pages by ``seq`` (newest first), mostly within one run, often within one
environment: ``(run, seq)`` and ``(run, env, seq)`` serve those pages from the index, and
replace ``(run, env)``. A rollout's reward becomes NULL when one of its scores carries an
error (the scorer failed; its value is not to be trusted and the trainer drops the
rollout): rewards recorded before this revision are recomputed so.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_rollouts_run_seq", "rollouts", ["run", "seq"])
    op.create_index("ix_rollouts_run_env_seq", "rollouts", ["run", "env", "seq"])
    op.drop_index("ix_rollouts_run_env", table_name="rollouts")
    op.execute("UPDATE rollouts SET reward = NULL WHERE EXISTS "
               "(SELECT 1 FROM scores WHERE scores.rollout_id = rollouts.id AND scores.error IS NOT NULL)")


def downgrade() -> None:
    op.create_index("ix_rollouts_run_env", "rollouts", ["run", "env"])
    op.drop_index("ix_rollouts_run_env_seq", table_name="rollouts")
    op.drop_index("ix_rollouts_run_seq", table_name="rollouts")
    op.execute("UPDATE rollouts SET reward = (SELECT sum(value * weight) FROM scores "
               "WHERE scores.rollout_id = rollouts.id) WHERE reward IS NULL")
