"""Reading runs from the trace store: the listing, one run with its counts, its steps' metrics.

Runs are recorded with their tenant, kind and scorers from the run-state bucket
(:meth:`flywheel_gateway.store_recording.RecordingStore.upsert_runs`), and each step's metrics
from its weight update.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from flywheel_gateway import schema as s
from flywheel_gateway.store_db import columns_of
from flywheel_gateway.store_pages import AwareDatetime, Page, PagedStore, check_limit


class RunStore(PagedStore):
    """Reads recorded runs and their steps."""

    async def list_runs(self, tenant: str | None = None, cursor: str | None = None, limit: int = 50) -> Page:
        """Runs the store knows, newest first (by creation time, then id)."""
        c = s.runs.c
        where = [c.tenant == self._text(tenant)] if tenant is not None else []
        return await self._page("runs", s.runs, columns_of(s.runs), where, cursor, limit,
                                order=(c.created_at, c.id), key_types=(AwareDatetime, str))

    async def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run with its counts and its latest step (None where no step is recorded yet).

        ``num_scored_rollouts`` counts rollouts with at least one score; ``reward_mean`` is the
        latest step's ``reward_mean`` metric. Counts are queries on the ``run`` indexes.
        """
        run_id = self._text(run_id)
        r, m = s.rollouts.c, s.run_metrics.c
        counts = sa.select(_count(s.tasks, s.tasks.c.run == run_id).label("num_tasks"),
                           _count(s.rollouts, r.run == run_id).label("num_rollouts"),
                           _count(s.rollouts, r.run == run_id, sa.exists().where(s.scores.c.rollout_id == r.id))
                           .label("num_scored_rollouts"))
        latest = sa.select(m.step, m.version, m.metrics).where(m.run == run_id).order_by(m.step.desc()).limit(1)
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(*columns_of(s.runs)).where(s.runs.c.id == run_id))).mappings().first()
            if row is None:
                return None
            found = {**row, **(await conn.execute(counts)).mappings().one()}
            step = (await conn.execute(latest)).mappings().first()
        found["latest_step"] = step["step"] if step else None
        found["latest_version"] = step["version"] if step else None
        found["reward_mean"] = step["metrics"].get("reward_mean") if step else None
        return found

    async def latest_steps(self, run_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Each run's latest recorded step (``step``, ``version``, ``reward_mean``), in one query;
        runs without a step are left out."""
        if not run_ids:
            return {}
        m = s.run_metrics.c
        ids = [self._text(run_id) for run_id in run_ids]
        newest = sa.select(m.run, sa.func.max(m.step).label("step")).where(m.run.in_(ids)).group_by(m.run).subquery()
        query = sa.select(m.run, m.step, m.version, m.metrics).join(
            newest, sa.and_(m.run == newest.c.run, m.step == newest.c.step))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return {row["run"]: {"step": row["step"], "version": row["version"],
                             "reward_mean": (row["metrics"] or {}).get("reward_mean")} for row in rows}

    async def run_tenant(self, run_id: str) -> str | None:
        """The tenant the store has for the run (None: no such run recorded)."""
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.runs.c.tenant).where(s.runs.c.id == self._text(run_id)))

    async def has_run(self, run_id: str) -> bool:
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.runs.c.id).where(s.runs.c.id == self._text(run_id))) is not None

    async def list_run_metrics(self, run_id: str, since_step: int | None = None,
                               limit: int = 100) -> list[dict[str, Any]]:
        """The run's steps after ``since_step`` (all without it), ascending, at most ``limit``."""
        check_limit(limit)
        m = s.run_metrics.c
        where = [m.run == self._text(run_id)] + ([m.step > since_step] if since_step is not None else [])
        query = sa.select(m.step, m.version, m.metrics, m.created_at).where(*where).order_by(m.step).limit(limit)
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]


def _count(table: sa.Table, *where: sa.ColumnElement[bool]) -> sa.ScalarSelect[int]:
    return sa.select(sa.func.count()).select_from(table).where(*where).scalar_subquery()
