"""A recorded rollout's graph is exactly the nodes its rollout event lists: drop phantom links.

Before this revision, live trace nodes of an attempt that inference abandoned (killed
mid-rollout; the task redelivered and rolled out again under the same rollout id) stayed
linked to the rollout after it was recorded, so its trace showed a phantom branch and its
last node by position could be a phantom's. The store now drops them when the rollout is
recorded (:meth:`flywheel_gateway.store.Store.record`); this revision drops the ones
recorded before. The rollout's own nodes already have its positions (the rollout's order
was written over the live one), so only the extra links go. No schema change; the
downgrade leaves the data as it is.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Links of recorded rollouts to nodes their event does not list; rollouts with only live
# nodes (not recorded yet) keep theirs.
_DROP_PHANTOMS = {
    "postgresql": "DELETE FROM rollout_nodes AS rn USING rollouts AS r WHERE rn.rollout_id = r.id "
                  "AND NOT (r.event -> 'nodes' @> jsonb_build_array(jsonb_build_object('id', rn.node_id)))",
    "sqlite": "DELETE FROM rollout_nodes WHERE rollout_id IN (SELECT id FROM rollouts) AND NOT EXISTS ("
              "SELECT 1 FROM rollouts AS r, json_each(r.event, '$.nodes') AS n WHERE r.id = rollout_nodes.rollout_id "
              "AND json_extract(n.value, '$.id') = rollout_nodes.node_id)",
}


def upgrade() -> None:
    op.execute(_DROP_PHANTOMS[op.get_bind().dialect.name])


def downgrade() -> None:
    pass
