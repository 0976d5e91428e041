"""lifecycle: an environment whose reward misbehaves on purpose, as its task says (``do``):
``crash`` ends its worker's process, ``hang`` holds its worker's event loop for a minute,
``slow`` takes a second, anything else scores 1.0 at once. The environment workers' lifecycle
tests (tests/integration/test_environment_workers.py) import it by name with ``tests/envs``
on ``sys.path``."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from flywheel.sdk.environment import Environment, Reward, TaskSet


async def behave(task: dict[str, Any]) -> float:
    what = task.get("do")
    if what == "crash":
        os._exit(3)
    if what == "hang":
        time.sleep(60)  # noqa: ASYNC251  # holds the worker's event loop, on purpose: what the test is about
    if what == "slow":
        await asyncio.sleep(1.0)
    return 1.0


def load_environment() -> Environment:
    return Environment(name="lifecycle_env", tasks=TaskSet.from_rows([{"do": "nothing"}]), prompt=lambda task: "hi",
                       rewards=[Reward(behave, name="behave")])
