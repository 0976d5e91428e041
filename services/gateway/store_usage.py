"""Usage in the trace store: what was used, summed by tenant, run and source or by time, and a run's
tokens counted again from its recorded rollouts, to check the metered ones against.

The counts come in as ``Usage`` events and with each rollout
(:mod:`flywheel_gateway.store_recording`); the sums run in SQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from flywheel_gateway import schema as s
from flywheel_gateway.store_db import StoreBase

# Who pays for a usage count: the tenant it names (an API caller's key), else the run's owner.
_PAYER = sa.func.coalesce(s.usage.c.tenant, s.runs.c.tenant, "default")
_USAGE_SUMS = (s.usage.c.num_calls, s.usage.c.prompt_tokens, s.usage.c.sampled_tokens, s.usage.c.trained_tokens,
               s.usage.c.sft_tokens)


class UsageStore(StoreBase):
    """Sums and recounts the usage recorded."""

    def _usage_query(self, keys: dict[str, sa.ColumnElement[Any]], tenant: str | None, run: str | None,
                     since: datetime | None, until: datetime | None) -> sa.Select[Any]:
        """Usage counts summed by ``keys`` (named), of the tenant's and run's counts made at or
        after ``since`` and before ``until``."""
        u = s.usage.c
        where = [(tenant, lambda v: _PAYER == v), (run, lambda v: u.run == v),
                 (since, lambda v: u.created_at >= v), (until, lambda v: u.created_at < v)]
        return (sa.select(*(key.label(name) for name, key in keys.items()), sa.func.count().label("num_counts"),
                          *(sa.func.sum(c).label(c.name) for c in _USAGE_SUMS),
                          sa.func.sum(u.sandbox_s).label("sandbox_s"))
                .select_from(s.usage.outerjoin(s.runs, s.runs.c.id == u.run))
                .where(*(make(self._text(v) if isinstance(v, str) else v) for v, make in where if v is not None))
                .group_by(*keys.values()).order_by(*keys.values()))

    async def _summed_usage(self, query: sa.Select[Any]) -> list[dict[str, Any]]:
        async with self.engine.connect() as conn:
            return [{**row, **{c.name: int(row[c.name] or 0) for c in _USAGE_SUMS},
                     "sandbox_s": float(row["sandbox_s"] or 0.0)}
                    for row in (await conn.execute(query)).mappings()]

    async def usage(self, tenant: str | None = None, run: str | None = None, since: datetime | None = None,
                    until: datetime | None = None) -> list[dict[str, Any]]:
        """What was used, summed by tenant, run and source (``rollout``, ``trainer``, ``sft``,
        ``api``, ``sandbox``), of counts made at or after ``since`` and before ``until``; the tenant is the
        one a count names (an API caller's key), else the run's owner."""
        u = s.usage.c
        keys = {"tenant": _PAYER, "run": u.run, "source": u.source}
        return await self._summed_usage(self._usage_query(keys, tenant, run, since, until))

    async def usage_over_time(self, bucket_s: int, tenant: str | None = None, run: str | None = None,
                              since: datetime | None = None, until: datetime | None = None) -> list[dict[str, Any]]:
        """What was used, summed by time bucket: buckets of ``bucket_s`` whole seconds from the
        Unix epoch (a day's start at 00:00 UTC), each row's ``start`` its bucket's; buckets
        without counts are left out. Filters as :meth:`usage`."""
        if bucket_s < 1:
            raise ValueError(f"bucket_s must be a whole number of seconds >= 1, got {bucket_s}")
        created = s.usage.c.created_at
        if self.dialect == "postgresql":
            seconds: sa.ColumnElement[int] = sa.cast(sa.func.floor(sa.extract("epoch", created)), sa.BigInteger)
        else:  # SQLite keeps the UTC wall time as text; its fraction dropped, strftime would round it up
            seconds = sa.cast(sa.func.strftime("%s", sa.func.substr(created, 1, 19)), sa.BigInteger)
        # A literal, not a parameter: the same expression in SELECT and GROUP BY.
        bucket = seconds // sa.literal_column(str(int(bucket_s)), sa.BigInteger)
        rows = await self._summed_usage(self._usage_query({"bucket": bucket}, tenant, run, since, until))
        for row in rows:
            row["start"] = datetime.fromtimestamp(row.pop("bucket") * bucket_s, UTC)
        return rows

    async def recount_usage(self, run: str) -> dict[str, int]:
        """A training run's tokens counted again from what the store holds, to check the metered
        ones against: each model call of its rollouts (an answer node with sampled tokens: its
        prompt is every token of the branch before them) and the sampled tokens of the rollouts a
        step trained (each node's once, as the trainer trains them). An eval run's rollouts are
        metered as API requests of the run it evaluates, so they are not recounted here."""
        run = self._text(run)
        rn, n, r, t = s.rollout_nodes.c, s.nodes.c, s.rollouts.c, s.trained_rollouts.c
        of_run = (sa.select(rn.rollout_id, n.id, n.parent_id, n.tokens)
                  .join_from(s.rollout_nodes, s.nodes, n.id == rn.node_id)
                  .join(s.rollouts, r.id == rn.rollout_id)
                  .where(r.run == run, r.run.in_(sa.select(s.runs.c.id).where(s.runs.c.kind == "train")))
                  .order_by(rn.rollout_id, rn.position))
        counts = {"num_calls": 0, "prompt_tokens": 0, "sampled_tokens": 0, "trained_tokens": 0}
        async with self.engine.connect() as conn:
            trained = set((await conn.scalars(sa.select(t.rollout_id).where(t.run == run))).all())
            graph: dict[str, tuple[str | None, list[int], list[bool]]] = {}
            current: str | None = None
            for row in await conn.execute(of_run):
                if row.rollout_id != current:
                    _recount_graph(graph, current in trained, counts)
                    graph, current = {}, row.rollout_id
                tokens = row.tokens or {}
                graph[row.id] = (row.parent_id, tokens.get("token_ids", []), tokens.get("loss_mask", []))
            _recount_graph(graph, current in trained, counts)
        return counts


def _recount_graph(graph: dict[str, tuple[str | None, list[int], list[bool]]], trained: bool,
                   counts: dict[str, int]) -> None:
    """Add one rollout's model calls (and, ``trained``, its trained tokens) to ``counts``:
    ``graph`` maps each of its nodes to (parent, token ids, loss mask)."""
    length: dict[str, int] = {}  # tokens of the branch up to and including a node

    def through(node: str | None) -> int:
        chain: list[str] = []
        while node is not None and node not in length and node in graph:
            chain.append(node)
            node = graph[node][0]
        total = length.get(node, 0) if node is not None else 0
        for each in reversed(chain):
            total += len(graph[each][1])
            length[each] = total
        return total

    for parent, _, loss_mask in graph.values():
        sampled = sum(loss_mask)
        if not sampled:
            continue
        counts["num_calls"] += 1
        counts["prompt_tokens"] += through(parent) + loss_mask.index(True)
        counts["sampled_tokens"] += sampled
        counts["trained_tokens"] += sampled if trained else 0
