"""``/v1/tasks``: publish tasks to the bus, read the recorded ones.

A POST is checked whole before anything of it is published: the fields (422), the size of each
task against the bus's max payload (413: a task too large is refused for good, it is not worth a
retry), and every run it names (409: another tenant's run, or a run that has ended; to a key,
the 409 of another tenant's run names no owner). A task without an ``id`` gets the one every
producer derives (:func:`flywheel.contract.events.task_id`: the data's own string ``"id"``, else
a hash of the run, env, data and its position in the request, from 1), so a POST retried without
ids is stored once, as a file published twice is. Not covered: partial acceptance (a request is
published whole or not at all, as far as the gateway decides; a bus failure part way leaves the
rest to a retry, which the bus deduplicates by task id).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException
from fastapi.exceptions import RequestValidationError

from flywheel.contract import events
from flywheel.contract.bus import Bus, PayloadTooLarge
from flywheel.sdk.environment import other_ids
from flywheel_gateway.auth import CallerDep, check_new_or_own_run, check_run, listing_tenant
from flywheel_gateway.deps import (
    BusDep,
    CursorQuery,
    EnvQuery,
    LimitQuery,
    RunQuery,
    RunsDep,
    StoreDep,
    TaskIdPath,
)
from flywheel_gateway.models import TaskCreate, TaskPage, TaskPublic, TasksAccepted, TasksCreate
from flywheel_gateway.responses import CONFLICT_RESPONSE, ERROR_RESPONSES, TOO_LARGE_RESPONSE

router = APIRouter(prefix="/v1/tasks", tags=["tasks"], responses=ERROR_RESPONSES)

@router.post("", status_code=202, response_model=TasksAccepted,
             responses={409: CONFLICT_RESPONSE, 413: TOO_LARGE_RESPONSE})
async def create_tasks(body: Annotated[TasksCreate, Body()], bus: BusDep, runs: RunsDep, store: StoreDep,
                       who: CallerDep) -> TasksAccepted:
    """Publish one task or a list of tasks to ``tasks.<run>.<env>``.

    Answers once JetStream has stored every task (202: they are queued, not yet run).
    A run not seen before is created in the run-state bucket, owned by the tenant. Nothing
    is published when any task is refused: 413 for a task larger than the bus takes, 409 for
    a run of another tenant or a run that has ended (finished, failed, stopped, abandoned).
    """
    creates: list[TaskCreate] = body if isinstance(body, list) else [body]
    tasks = _tasks(creates, "tasks" if isinstance(body, list) else "task")
    _refuse_oversized(tasks, bus, "tasks" if isinstance(body, list) else "task")
    for run in dict.fromkeys(t.run for t in tasks):
        await check_new_or_own_run(who, store, bus, run)
    await runs.admit((t.run for t in tasks), who.tenant)
    await bus.publish_many(tasks)
    return TasksAccepted(ids=[t.id for t in tasks])


def _tasks(creates: list[TaskCreate], name: str) -> list[events.Task]:
    """The request's tasks, each with its id (given, or derived from its position from 1); 422
    for an id that cannot be one (a blank ``data.id``) or that repeats another task's."""
    tasks: list[events.Task] = []
    first: dict[str, str] = {}  # task id -> where it was first given: tasks[0].id, tasks[3].data.id
    errors = []
    for i, c in enumerate(creates):
        loc = ("body", name, i) if name == "tasks" else ("body", name)
        field = ("id",) if c.id is not None else ("data", "id")
        try:
            task = c.to_event(position=i + 1)
        except ValueError as exc:
            errors.append({"loc": (*loc, *field), "type": "value_error", "msg": str(exc)})
            continue
        if task.id in first:
            errors.append({"loc": (*loc, *field), "type": "value_error",
                           "msg": f"repeats {first[task.id]} ({task.id!r}); task ids must be unique"})
        first.setdefault(task.id, f"tasks[{i}].{'.'.join(field)}")
        tasks.append(task)
    if errors:
        raise RequestValidationError(errors)
    return tasks


def _refuse_oversized(tasks: list[events.Task], bus: Bus, name: str) -> None:
    too_large: list[str] = []
    for i, task in enumerate(tasks):
        try:
            bus.check_fits(task)
        except PayloadTooLarge as exc:
            where = f"tasks[{i}]" if name == "tasks" else "task"
            too_large.append(f"{where} is {exc.size} bytes as published (payload and headers), above the bus's max "
                             f"payload of {exc.limit} bytes")
    if too_large:
        raise HTTPException(413, "; ".join(too_large) + "; make the task data smaller (e.g. store large inputs "
                                                        "elsewhere and send a reference), or raise the NATS server's "
                                                        "max_payload")


@router.get("", response_model=TaskPage)
async def list_tasks(store: StoreDep, who: CallerDep, limit: LimitQuery = 50, cursor: CursorQuery = None,
                     run: RunQuery = None, env: EnvQuery = None) -> TaskPage:
    """Recorded tasks, newest first (with an API key: its tenant's). ``env`` is the name in the
    tasks' subjects (``reverse_text``) or an installed package's id (``flywheel/reverse-text``):
    either finds the other's."""
    page = await store.list_tasks(run=run, env=env, cursor=cursor, limit=limit, tenant=listing_tenant(who, None),
                                  env_aliases=other_ids(env) if env is not None else ())
    return TaskPage.model_validate(page, from_attributes=True)


@router.get("/{task_id}", response_model=TaskPublic)
async def get_task(task_id: TaskIdPath, store: StoreDep, bus: BusDep, who: CallerDep) -> TaskPublic:
    """A recorded task (another tenant's, to a key, is a 404 as one not recorded is)."""
    not_found = HTTPException(404, f"task {task_id!r} not found (a task shows here once the recorder has stored it)")
    task = await store.get_task(task_id)
    if task is None:
        raise not_found
    await check_run(who, store, bus, task["run"], not_found)
    return TaskPublic.model_validate(task)
