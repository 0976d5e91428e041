"""A run's reward per environment: ``run_scorers`` gets ``env``, its key (run, env, scorer).

A run with several environments rewards each with its own scorers (``RunState.env_scorers``),
so a rollout of one environment must not wait for the scorers of another, nor count them.
The recorder writes such a run's rows per environment (``env``, its name in subjects), and
a run with one environment its ``RunState.scorers`` under ``env`` '' (every environment of
the run). The rows recorded before this revision are of runs with one reward: they get ''
and every reward stays as it is. The downgrade drops the rows of single environments (the
old key cannot hold one scorer twice); the recorder writes those runs' ``scorers`` again
when it mirrors their states, and recomputes their rewards then.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-16
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# PostgreSQL's name for the primary key 0005 created; this revision keeps it.
_PRIMARY_KEY = "run_scorers_pkey"


def upgrade() -> None:
    # SQLite alters a table by copying it (batch mode), from this: the table as 0005 made it,
    # its primary key named as on PostgreSQL (SQLite's has no name), so both drop it by name.
    before = sa.Table("run_scorers", sa.MetaData(),
                      sa.Column("run", sa.String(), nullable=False),
                      sa.Column("scorer", sa.String(), nullable=False),
                      sa.Column("weight", sa.Float(), nullable=False),
                      sa.PrimaryKeyConstraint("run", "scorer", name=_PRIMARY_KEY))
    with op.batch_alter_table("run_scorers", copy_from=before) as batch:
        batch.add_column(sa.Column("env", sa.String(), nullable=False, server_default=""))
        batch.drop_constraint(_PRIMARY_KEY, type_="primary")
        batch.create_primary_key(_PRIMARY_KEY, ["run", "env", "scorer"])


def downgrade() -> None:
    op.execute("DELETE FROM run_scorers WHERE env <> ''")
    with op.batch_alter_table("run_scorers") as batch:
        batch.drop_constraint(_PRIMARY_KEY, type_="primary")
        batch.drop_column("env")
        batch.create_primary_key(_PRIMARY_KEY, ["run", "scorer"])
