"""lifecycle: an environment whose reward misbehaves on purpose, as its task says (``do``):
``crash`` ends its worker's process, ``hang`` holds its worker's event loop for a minute,
``slow`` takes a second, ``ask`` fetches the task's ``url`` (through the worker's host: an endpoint
the run config names, :mod:`flywheel.sdk.egress`) and scores 1.0 when it answers ``pong``,
anything else scores 1.0 at once. The environment workers' lifecycle
tests (tests/integration/test_environment_workers.py) import it by name with ``tests/envs``
on ``sys.path``."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from flywheel.sdk import egress
from flywheel.sdk.environment import Environment, Reward, TaskSet


async def behave(task: dict[str, Any]) -> float:
    what = task.get("do")
    if what == "crash":
        os._exit(3)
    if what == "hang":
        time.sleep(60)  # noqa: ASYNC251  # noqa: sleep - holds the worker's event loop on purpose
    if what == "slow":
        await asyncio.sleep(1.0)  # noqa: sleep - a slow reward, on purpose: what "slow" asks for
    if what == "ask":
        client = egress.http_client(10.0)
        assert client is not None, "in a worker, an outside call goes through its host"
        async with client:
            answer = await client.get(task["url"])
        return float(answer.text == "pong")
    return 1.0


def load_environment(judge_url: str | None = None) -> Environment:  # judge_url: an endpoint it may ask
    return Environment(name="lifecycle_env", tasks=TaskSet.from_rows([{"do": "nothing"}]), prompt=lambda task: "hi",
                       rewards=[Reward(behave, name="behave")])
