"""Initial schema of the trace store: runs, tasks, rollouts, nodes, scores, weights, dead letters.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Types as they were at this revision (a migration never follows later model changes).
Json = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
UTCDateTime = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_table(
        "tasks",
        sa.Column("seq", Seq, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(), nullable=False, unique=True),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("env", sa.String(), nullable=False),
        sa.Column("data", Json, nullable=False),
        sa.Column("num_rollouts", sa.Integer(), nullable=False),
        sa.Column("sampling", Json, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_index("ix_tasks_run_env", "tasks", ["run", "env"])
    op.create_table(
        "rollouts",
        sa.Column("seq", Seq, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(), nullable=False, unique=True),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("env", sa.String(), nullable=False),
        sa.Column("task_id", sa.String(), nullable=False),
        sa.Column("group_id", sa.String(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("event", Json, nullable=False),
    )
    op.create_index("ix_rollouts_run_env", "rollouts", ["run", "env"])
    op.create_index("ix_rollouts_task_id", "rollouts", ["task_id"])
    op.create_index("ix_rollouts_group_id", "rollouts", ["group_id"])
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("parent_id", sa.String(), nullable=True),
        sa.Column("role", sa.String(), nullable=False),
        sa.Column("message", Json, nullable=False),
        sa.Column("tokens", Json, nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=True),
    )
    op.create_table(
        "rollout_nodes",
        sa.Column("rollout_id", sa.String(), primary_key=True),
        sa.Column("node_id", sa.String(), primary_key=True),
        sa.Column("position", sa.Integer(), nullable=False),
    )
    op.create_table(
        "scores",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("env", sa.String(), nullable=False),
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("group_id", sa.String(), nullable=False),
        sa.Column("scorer", sa.String(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("components", Json, nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.UniqueConstraint("rollout_id", "scorer", name="uq_scores_rollout_scorer"),
    )
    op.create_table(
        "weight_updates",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("uri", sa.String(), nullable=False),
        sa.Column("sha256", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("format", sa.String(), nullable=False),
        sa.Column("trainer_step", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_index("ix_weight_updates_run", "weight_updates", ["run"])
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("stream", sa.String(), nullable=False),
        sa.Column("original_subject", sa.String(), nullable=False),
        sa.Column("consumer", sa.String(), nullable=False),
        sa.Column("num_delivered", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("headers", Json, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_index("ix_dead_letters_stream", "dead_letters", ["stream"])


def downgrade() -> None:
    for table in ("dead_letters", "weight_updates", "scores", "rollout_nodes", "nodes", "rollouts", "tasks", "runs"):
        op.drop_table(table)
