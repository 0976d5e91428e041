"""The environment hub: environments, their immutable versions, each version's package files, and
the evals pushed to a version (its leaderboard).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Types as they were at this revision (a migration never follows later model changes).
UTCDateTime = sa.DateTime(timezone=True)
Json = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def upgrade() -> None:
    op.create_table(
        "hub_environments",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("project", sa.String(), nullable=False),
        sa.Column("private", sa.Boolean(), nullable=False),
        sa.Column("forked_from", sa.String(), nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project"),
    )
    op.create_index("ix_hub_environments_owner", "hub_environments", ["owner"])
    op.create_table(
        "hub_versions",
        sa.Column("env_id", sa.String(), nullable=False),
        sa.Column("version", sa.String(), nullable=False),
        sa.Column("sha256", sa.String(), nullable=False),
        sa.Column("summary", sa.String(), nullable=False),
        sa.Column("readme", sa.Text(), nullable=False),
        sa.Column("pushed_by", sa.String(), nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("env_id", "version"),
    )
    op.create_table(
        "hub_files",
        sa.Column("filename", sa.String(), nullable=False),
        sa.Column("env_id", sa.String(), nullable=False),
        sa.Column("version", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("sha256", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("filename"),
    )
    op.create_index("ix_hub_files_env_id_version", "hub_files", ["env_id", "version"])
    op.create_table(
        "hub_evals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("env_id", sa.String(), nullable=False),
        sa.Column("version", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("reward_mean", sa.Float(), nullable=True),
        sa.Column("reward_stderr", sa.Float(), nullable=True),
        sa.Column("pass_at", Json, nullable=False),
        sa.Column("num_tasks", sa.Integer(), nullable=False),
        sa.Column("num_rollouts", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("pushed_by", sa.String(), nullable=True),
        sa.Column("summary", Json, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_hub_evals_env_id_version", "hub_evals", ["env_id", "version"])


def downgrade() -> None:
    op.drop_index("ix_hub_evals_env_id_version", table_name="hub_evals")
    op.drop_table("hub_evals")
    op.drop_index("ix_hub_files_env_id_version", table_name="hub_files")
    op.drop_table("hub_files")
    op.drop_table("hub_versions")
    op.drop_index("ix_hub_environments_owner", table_name="hub_environments")
    op.drop_table("hub_environments")
