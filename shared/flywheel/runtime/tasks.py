"""Tasks built from rows, the one way every producer builds them (the CLI's ``tasks publish``,
the client's :meth:`flywheel.ops.client.Client.publish_tasks`, a run's owner): each row checked,
its id made by :func:`flywheel.contract.events.task_id`, ids unique within the batch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flywheel.contract import events
from flywheel.contract.names import check_run_id, check_token


def make_tasks(
    run: str,
    env: str,
    numbered_rows: Iterable[tuple[int, dict[str, Any]]],
    *,
    num_rollouts: int = 1,
    sampling: events.Sampling | None = None,
    source: str | None = None,
) -> list[events.Task]:
    """Validate and build one Task per ``(position, row)``; raises ValueError naming the field.

    ``source`` (a file name) makes errors read ``source:position`` instead of ``row position``.
    """
    check_run_id(run)
    check_token("env", env)
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts must be at least 1, got {num_rollouts}")
    if sampling is not None:
        sampling.check()  # what the gateway and inference accept, refused here before anything is sent
    tasks = []
    first_seen: dict[str, str] = {}  # task id -> where
    for position, row in numbered_rows:
        where = f"{source}:{position}" if source else f"row {position}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a task row must be a JSON object (dict), got {type(row).__name__}")
        try:
            tid = events.task_id(run, env, position, row)
        except TypeError as exc:
            raise ValueError(f"{where}: not JSON-serializable: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        if tid in first_seen:
            raise ValueError(f"{where}: id {tid!r} repeats {first_seen[tid]}; task ids must be unique "
                             "(a repeated id would be dropped as a duplicate)")
        first_seen[tid] = where
        tasks.append(events.Task(id=tid, run=run, env=env, data=row, num_rollouts=num_rollouts, sampling=sampling))
    return tasks
