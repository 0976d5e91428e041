"""``/v1/tasks``: publish tasks to the bus, read the recorded ones."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException
from fastapi.exceptions import RequestValidationError

from flywheel_gateway.deps import BusDep, CursorQuery, LimitQuery, RunsDep, StoreDep, TenantDep
from flywheel_gateway.models import TaskCreate, TaskPage, TaskPublic, TasksAccepted, TasksCreate
from flywheel_gateway.responses import ERROR_RESPONSES

router = APIRouter(prefix="/v1/tasks", tags=["tasks"], responses=ERROR_RESPONSES)


@router.post("", status_code=202, response_model=TasksAccepted)
async def create_tasks(body: Annotated[TasksCreate, Body()], bus: BusDep, runs: RunsDep,
                       tenant: TenantDep = "default") -> TasksAccepted:
    """Publish one task or a list of tasks to ``tasks.<run>.<env>``.

    Answers once JetStream has stored every task (202: they are queued, not yet run).
    A run not seen before is created in the run-state bucket, owned by the tenant.
    """
    creates: list[TaskCreate] = body if isinstance(body, list) else [body]
    _refuse_repeated_ids(creates)
    tasks = [c.to_event() for c in creates]
    await runs.ensure((t.run for t in tasks), tenant)
    await bus.publish_many(tasks)
    return TasksAccepted(ids=[t.id for t in tasks])


def _refuse_repeated_ids(creates: list[TaskCreate]) -> None:
    first: dict[str, int] = {}
    errors = []
    for i, c in enumerate(creates):
        if c.id is None:
            continue
        if c.id in first:
            errors.append({"loc": ("body", "tasks", i, "id"), "type": "value_error",
                           "msg": f"repeats tasks[{first[c.id]}].id ({c.id!r}); task ids must be unique"})
        first.setdefault(c.id, i)
    if errors:
        raise RequestValidationError(errors)


@router.get("", response_model=TaskPage)
async def list_tasks(store: StoreDep, limit: LimitQuery = 50, cursor: CursorQuery = None,
                     run: str | None = None, env: str | None = None) -> TaskPage:
    """Recorded tasks, newest first."""
    page = await store.list_tasks(run=run, env=env, cursor=cursor, limit=limit)
    return TaskPage.model_validate(page, from_attributes=True)


@router.get("/{task_id}", response_model=TaskPublic)
async def get_task(task_id: str, store: StoreDep) -> TaskPublic:
    task = await store.get_task(task_id)
    if task is None:
        raise HTTPException(404, f"task {task_id!r} not found (a task shows here once the recorder has stored it)")
    return TaskPublic.model_validate(task)
