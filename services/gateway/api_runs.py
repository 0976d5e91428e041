"""``/v1/runs``: runs, how far they got, and their training metrics step by step.

A run's detail joins two sources: the trace store (tenant copy, counts of tasks, rollouts
and scored rollouts, each step's metrics from the trainer's weight updates) and the
run-state bucket, read live (status, config, and the tenant, which the bucket owns). A run
is found when either knows it: one created in the bucket (by the gateway or ``flywheel
run``) shows before any of its events is recorded. The listing is the store's alone.

Run ids may contain ``/``, so the routes take the rest of the path as the id
(``/v1/runs/team/a/metrics`` is run ``team/a``). Not covered: creating, stopping or
deleting runs, and pushing metrics to clients (they poll with ``since_step``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import AfterValidator

from flywheel import runs
from flywheel_gateway.deps import BusDep, CursorQuery, LimitQuery, StoreDep
from flywheel_gateway.models import RunDetail, RunMetricsPublic, RunPage, StepMetricsPublic, run_id
from flywheel_gateway.responses import ERROR_RESPONSES
from flywheel_gateway.store import MAX_PAGE_LIMIT

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERROR_RESPONSES)

RunIdPath = Annotated[str, Path(description="Run id (letters, digits, - _ = /)."), AfterValidator(run_id)]


def _not_found(run: str) -> HTTPException:
    return HTTPException(404, f"run {run!r} not found (a run shows here once it is created, or once the recorder "
                              "has stored one of its events)")


@router.get("", response_model=RunPage)
async def list_runs(store: StoreDep, limit: LimitQuery = 50, cursor: CursorQuery = None,
                    tenant: str | None = None) -> RunPage:
    """Runs the trace store knows, newest first; ``tenant`` keeps one tenant's."""
    page = await store.list_runs(tenant=tenant, cursor=cursor, limit=limit)
    return RunPage.model_validate(page, from_attributes=True)


@router.get("/{run_id:path}/metrics", response_model=RunMetricsPublic)
async def get_run_metrics(
    run_id: RunIdPath,
    store: StoreDep,
    bus: BusDep,
    since_step: Annotated[int | None, Query(description="Only steps after this one.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT, description="Steps at most.")] = 100,
) -> RunMetricsPublic:
    """The run's recorded steps in ascending order, each with the trainer's metrics."""
    if not await store.has_run(run_id) and await runs.get_run(bus, run_id) is None:
        raise _not_found(run_id)
    steps = await store.list_run_metrics(run_id, since_step=since_step, limit=limit)
    return RunMetricsPublic(run=run_id, items=[StepMetricsPublic.model_validate(step) for step in steps])


@router.get("/{run_id:path}", response_model=RunDetail)
async def get_run(run_id: RunIdPath, store: StoreDep, bus: BusDep) -> RunDetail:
    """The run: tenant, live status and config, latest step and version, counts, latest reward mean."""
    recorded = await store.get_run(run_id)
    state = await runs.get_run(bus, run_id)
    if state is None:
        if recorded is None:
            raise _not_found(run_id)
        return RunDetail.model_validate({**recorded, "status": None, "config": None})
    if recorded is None:  # created in the bucket, nothing of it recorded yet
        recorded = {"id": run_id, "created_at": state.created_at, "num_tasks": 0, "num_rollouts": 0,
                    "num_scored_rollouts": 0, "latest_step": None, "latest_version": None, "reward_mean": None}
    # The bucket owns the tenant: the store's copy may predate it (an event recorded first).
    return RunDetail.model_validate({**recorded, "tenant": state.tenant, "kind": state.kind,
                                     "status": state.status, "config": state.config})
