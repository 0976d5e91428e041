"""Reading tasks and rollouts from the trace store: listings, filters, one rollout, its trace, the export.

Rollouts are filtered in SQL (:class:`RolloutFilter`: run, environment, status, error, reward,
policy version, time), listed a page at a time (:mod:`flywheel_gateway.store_pages`), and
exported as one record each (:func:`export_record`): the export reads a page at a time and
releases its connection before handing the page out. A rollout read from the store has its
``error`` say why it counts as one (:func:`flywheel_gateway.store_reward.shown_error`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from flywheel.contract import events
from flywheel.sdk.tracegraph import ROWS, final_branch, join_tokens
from flywheel_gateway import schema as s
from flywheel_gateway.store_db import columns_of, in_chunks
from flywheel_gateway.store_pages import Page, PagedStore, check_limit, fingerprint
from flywheel_gateway.store_reward import has_error, shown_error


@dataclass
class RolloutFilter:
    """Filters of the rollout listing and export; None means no filter.

    Reward and policy-version bounds are inclusive; a reward bound leaves out rollouts
    without a reward (not scored yet, or a scorer failed on them). ``created_after`` is
    inclusive and ``created_before`` exclusive, so consecutive windows never overlap.
    ``error``: True keeps rollouts with an error (inference marked them ``error`` or gave an
    error message, or a scorer failed on them), False keeps the others; a rollout read from
    the store has its ``error`` say why (:func:`shown_error`), so the two agree.
    """

    run: str | None = None
    env: str | None = None
    env_aliases: tuple[str, ...] | None = None  # env's other ids: its rollouts are of runs configured with these too
    status: str | None = None
    error: bool | None = None
    flagged: bool | None = None  # flagged by the reward-hacking watch (a score of the scorer 'watch')
    tenant: str | None = None  # only the runs of this tenant
    policy_version: int | None = None
    min_policy_version: int | None = None
    max_policy_version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None

    def where(self) -> list[sa.ColumnElement[bool]]:
        c = s.rollouts.c
        conditions = [
            (self.run, lambda v: c.run == v),
            (self.env, lambda v: _of_env(v, self.env_aliases or ())),
            (self.status, lambda v: c.status == v),
            (self.tenant, lambda v: c.run.in_(sa.select(s.runs.c.id).where(s.runs.c.tenant == v))),
            (self.error, lambda v: has_error() if v else sa.not_(has_error())),
            (self.flagged, lambda v: _flagged(c.id) if v else sa.not_(_flagged(c.id))),
            (self.policy_version, lambda v: c.policy_version == v),
            (self.min_policy_version, lambda v: c.policy_version >= v),
            (self.max_policy_version, lambda v: c.policy_version <= v),
            (self.min_reward, lambda v: c.reward >= v),
            (self.max_reward, lambda v: c.reward <= v),
            (self.created_after, lambda v: c.created_at >= v),
            (self.created_before, lambda v: c.created_at < v),
        ]
        return [make(value) for value, make in conditions if value is not None]

    def fingerprint(self) -> str:
        """A short digest of the filters, carried in cursors: a cursor only continues its own listing."""
        return fingerprint(asdict(self))


def _flagged(rollout_id: sa.ColumnElement[str]) -> sa.Exists:
    sc = s.scores.c
    return sa.exists().where(sc.rollout_id == rollout_id, sc.scorer == events.WATCH_SCORER)


def _is_env_id(column: sa.ColumnElement[Any], env_ids: Sequence[str]) -> sa.ColumnElement[bool]:
    """``column`` holds one of ``env_ids``, or it with ``@VERSION`` (an id without a version takes any)."""
    return sa.or_(*(sa.or_(column == env_id, column.startswith(f"{env_id}@", autoescape=True)) for env_id in env_ids))


def _of_env(env: str, aliases: Sequence[str]) -> sa.ColumnElement[bool]:
    """Rollouts of ``env``: the name in their subjects, or the id their run was configured with
    (the run's one, or in a run of several this rollout's environment's), ``env`` or one of
    ``aliases``, its other ids (a hub id's module, a module's hub id)."""
    c, ids = s.rollouts.c, [env, *aliases]
    return sa.or_(c.env == env, c.run.in_(sa.select(s.runs.c.id).where(_is_env_id(s.runs.c.env, ids))),
                  sa.exists().where(s.run_envs.c.run == c.run, s.run_envs.c.env == c.env,
                                    _is_env_id(s.run_envs.c.env_id, ids)))


class RolloutStore(PagedStore):
    """Reads recorded tasks, rollouts, their traces and signals."""

    async def list_tasks(self, run: str | None = None, env: str | None = None, cursor: str | None = None,
                         limit: int = 50, tenant: str | None = None, env_aliases: Sequence[str] = ()) -> Page:
        """Recorded tasks, newest first; ``env`` or any of ``env_aliases`` (its other ids)."""
        c = s.tasks.c
        where = [c.run == self._text(run)] if run is not None else []
        where += [c.env.in_([self._text(e) for e in (env, *env_aliases)])] if env is not None else []
        where += [c.run.in_(sa.select(s.runs.c.id).where(s.runs.c.tenant == self._text(tenant)))] \
            if tenant is not None else []
        return await self._page("tasks", s.tasks, columns_of(s.tasks), where, cursor, limit,
                                scope=fingerprint({"run": run, "env": env, "tenant": tenant}))

    async def get_task(self, task_id: str) -> dict[str, Any] | None:
        task_id = self._text(task_id)
        async with self.engine.connect() as conn:
            query = sa.select(*columns_of(s.tasks)).where(s.tasks.c.id == task_id)
            row = (await conn.execute(query)).mappings().first()
        return dict(row) if row is not None else None

    async def list_rollouts(self, filters: RolloutFilter | None = None, cursor: str | None = None,
                            limit: int = 50) -> Page:
        filters = filters or RolloutFilter()
        page = await self._page("rollouts", s.rollouts, columns_of(s.rollouts, "event"), self._where(filters), cursor,
                                limit, scope=filters.fingerprint())
        failed = await self._failed_scores([row["id"] for row in page.items])
        for row in page.items:
            row["error"] = shown_error(row["status"], row["error"], failed.get(row["id"], []))
        return page

    async def _failed_scores(self, rollout_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """The scores with an error of ``rollout_ids``, by rollout, in scorer order."""
        sc = s.scores.c
        by_rollout: dict[str, list[dict[str, Any]]] = {}
        async with self.engine.connect() as conn:
            for chunk in in_chunks(rollout_ids):
                found = await conn.execute(sa.select(sc.rollout_id, sc.scorer, sc.error)
                                           .where(sc.rollout_id.in_(chunk), sc.error.is_not(None))
                                           .order_by(sc.rollout_id, sc.scorer))
                for score in found.mappings():
                    by_rollout.setdefault(score["rollout_id"], []).append(dict(score))
        return by_rollout

    def _where(self, filters: RolloutFilter) -> list[sa.ColumnElement[bool]]:
        run = self._text(filters.run) if filters.run is not None else None
        env = self._text(filters.env) if filters.env is not None else None
        aliases = tuple(self._texts(filters.env_aliases)) if filters.env_aliases is not None else None
        return replace(filters, run=run, env=env, env_aliases=aliases).where()

    async def export_rollouts(self, filters: RolloutFilter | None = None, tokens: bool = False,
                              page_size: int = 100) -> AsyncIterator[dict[str, Any]]:
        """Every rollout that ``filters`` keep, newest first, as one export record each (see
        :func:`export_record`). Read ``page_size`` at a time, each page on a connection that
        is released before its records are handed out: memory stays flat however many rows
        match, and a slow reader holds no connection. Rollouts recorded after the first
        page are not included."""
        check_limit(page_size)
        c, sc = s.rollouts.c, s.scores.c
        where = self._where(filters or RolloutFilter())
        columns = [c.seq, *columns_of(s.rollouts)]
        score_columns = [sc.rollout_id, sc.scorer, sc.value, sc.weight, sc.components, sc.error]
        last_seq: int | None = None
        while True:
            query = (sa.select(*columns).where(*where, *([c.seq < last_seq] if last_seq is not None else []))
                     .order_by(c.seq.desc()).limit(page_size))
            async with self.engine.connect() as conn:
                rows = [dict(row) for row in (await conn.execute(query)).mappings()]
                by_rollout: dict[str, list[dict[str, Any]]] = {}
                if rows:
                    ids = [r["id"] for r in rows]
                    found = await conn.execute(sa.select(*score_columns).where(sc.rollout_id.in_(ids))
                                               .order_by(sc.rollout_id, sc.scorer))
                    for score in found.mappings():
                        by_rollout.setdefault(score["rollout_id"], []).append(
                            {k: v for k, v in score.items() if k != "rollout_id"})
            for row in rows:
                yield export_record(row, by_rollout.get(row["id"], []), tokens)
            if len(rows) < page_size:
                return
            last_seq = rows[-1]["seq"]
            del rows, by_rollout  # not held while the next page is read

    async def has_rollout(self, rollout_id: str) -> bool:
        """Whether the rollout itself (not only live trace nodes of it) is recorded."""
        rollout_id = self._text(rollout_id)
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.rollouts.c.id).where(s.rollouts.c.id == rollout_id)) is not None

    async def get_rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout (without its nodes), its metrics and task data, and its scores."""
        rollout_id = self._text(rollout_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(
                sa.select(*columns_of(s.rollouts)).where(s.rollouts.c.id == rollout_id))).mappings().first()
            if row is None:
                return None
            scores = (await conn.execute(
                sa.select(*columns_of(s.scores)).where(s.scores.c.rollout_id == rollout_id)
                .order_by(s.scores.c.scorer))).mappings().all()
        out = dict(row)
        event = out.pop("event")
        out["metrics"] = event.get("metrics", {})
        out["task_data"] = event.get("task_data", {})
        out["scores"] = [dict(sc) for sc in scores]
        out["error"] = shown_error(out["status"], out["error"], out["scores"])
        return out

    async def rollout_run(self, rollout_id: str) -> str | None:
        """The run of a recorded rollout (None: not recorded)."""
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.rollouts.c.run).where(s.rollouts.c.id == self._text(rollout_id)))

    async def get_trace(self, rollout_id: str, tokens: bool = False) -> list[dict[str, Any]] | None:
        """The nodes of a rollout's graph in order; None when nothing of it is recorded."""
        rollout_id = self._text(rollout_id)
        n, rn = s.nodes.c, s.rollout_nodes.c
        columns = [n.id, n.parent_id, rn.position, n.message] + ([n.tokens] if tokens else [])
        query = (sa.select(*columns).join_from(s.rollout_nodes, s.nodes, n.id == rn.node_id)
                 .where(rn.rollout_id == rollout_id).order_by(rn.position, n.id))
        async with self.engine.connect() as conn:
            rows = [dict(row) for row in (await conn.execute(query)).mappings()]
            if not rows:
                found = await conn.scalar(sa.select(s.rollouts.c.id).where(s.rollouts.c.id == rollout_id))
                return [] if found is not None else None
        return rows

    async def get_signals(self, rollout_id: str) -> list[dict[str, Any]]:
        """The teachers' signals recorded for a rollout, by source."""
        g = s.signals.c
        query = (sa.select(g.source, g.model, g.temperature, g["values"], g.error)
                 .where(g.rollout_id == self._text(rollout_id)).order_by(g.source))
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]


def export_record(row: dict[str, Any], scores: list[dict[str, Any]], tokens: bool) -> dict[str, Any]:
    """One rollout as an export line: its fields, reward and scores, and the messages of its
    final branch (root to its last node, the branch rewards read; the whole rollout unless
    it branches); with ``tokens``, that branch's concatenated token layer too."""
    event = row["event"]
    nodes = event.get("nodes", [])
    branch = final_branch(nodes, ROWS)
    record = {k: v for k, v in row.items() if k not in ("seq", "event")}
    record["error"] = shown_error(row["status"], row["error"], scores)
    record.update(task_data=event.get("task_data", {}), metrics=event.get("metrics", {}),
                  state=event.get("state", {}), scores=scores,
                  num_nodes=len(nodes), messages=[{"content": "", **n["message"]} for n in branch])
    if tokens:
        joined = join_tokens(branch, ROWS)
        record["tokens"] = {"token_ids": joined.token_ids, "logprobs": joined.logprobs, "loss_mask": joined.loss_mask}
    return record
