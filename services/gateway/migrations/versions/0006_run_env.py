"""A run's environment id (``runs.env``), from its config: the trace API's ``env=`` filter
takes the id a user ran with (``owner/name[@version]``) as well as the name in the rollouts'
subjects. Runs recorded before this revision get theirs when their state is mirrored again
(the recorder reads every run's state when it starts).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("env", sa.String(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "env")
