"""The environments of a run with several (``run_envs``): each one's id in the run config by
its name in subjects (``RunState.env_ids``), so the trace API's ``env=`` filter takes the id a
user ran it with (``owner/name[@version]``) for such runs too, as ``runs.env`` gives it for a
run with one. Runs recorded before this revision get their rows when their state is mirrored
again (the recorder reads every run's state when it starts).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_envs",
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("env", sa.String(), nullable=False),
        sa.Column("env_id", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("run", "env"),
    )


def downgrade() -> None:
    op.drop_table("run_envs")
