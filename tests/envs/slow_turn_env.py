"""slow-turn: one model call, then an environment turn that waits ``task["wait_s"]`` seconds
(a slow tool, sandbox or user simulator), whatever the model answered. Tests import it by
name with ``tests/envs`` on ``sys.path``."""

from __future__ import annotations

import asyncio
from typing import Any

from flywheel.sdk.environment import Environment, Reward, TaskSet
from flywheel.sdk.harness import RolloutContext


class SlowTurn:
    def initial_messages(self, env: Any, task: dict[str, Any]) -> list[Any]:
        return env.first_messages(task)

    async def run(self, env: Any, ctx: RolloutContext) -> None:
        await ctx.chat(messages=[{"role": "user", "content": ctx.task["text"]}])
        await asyncio.sleep(ctx.task["wait_s"])  # noqa: sleep - the slow environment turn this env stands for


def load_environment() -> Environment:
    return Environment(
        name="slow_turn_env",
        tasks=TaskSet.from_rows([{"text": "abc", "wait_s": 60.0}], schema={"text": str, "wait_s": float}),
        harness=SlowTurn(),
        prompt=lambda task: task["text"],
        rewards=[Reward(lambda completion: float(bool(completion)), name="answered")],
    )
