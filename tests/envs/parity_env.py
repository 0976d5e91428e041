"""A test environment that ends the same in ``flywheel eval`` and in training whatever the model
says (tests/integration/test_eval_training_parity.py): multi-turn, with a tool and state.

Each turn the harness asks the model (and does not read the answer: the tests' models answer
noise), calls its ``tally`` tool, whose answer is the next user message, and keeps the tally
in ``state``; after the row's ``turns`` it ends the episode itself (``state["truncated"]``).
The row's ``mode`` picks how the rollout ends or scores: ``play`` (as said), ``raise`` (the
harness fails after its turns), ``hang`` (it never returns: the rollout timeout ends it),
``silent`` (it never calls the model), ``board`` (it leaves a state that is not JSON),
``bad_reward`` (a reward returns a non-number), ``slow_reward`` (a reward runs past its
timeout). Rewards read the state, the task and the messages' count, never their text; a
group reward favours each group's first rollout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flywheel.contract import events
from flywheel.sdk.environment import Environment, GroupReward, Metric, Reward, TaskSet
from flywheel.sdk.harness import RolloutContext, Tool
from flywheel.sdk.messages import message_dict

MODES = ("play", "raise", "hang", "silent", "board", "bad_reward", "slow_reward")


class Board:
    """A game board that is not JSON."""


def tally(n: int, ctx: RolloutContext) -> str:
    """Add n to the rollout's tally."""
    ctx.state["tally"] = ctx.state.get("tally", 0) + n
    return f"tally {ctx.state['tally']}"


class TurnsHarness:
    tool = Tool(tally)

    def initial_messages(self, env: Environment, task: dict[str, Any]) -> list[events.Message]:
        return env.first_messages(task)

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        mode = ctx.task["mode"]
        messages = [message_dict(m) for m in self.initial_messages(env, ctx.task)]
        num_turns = 0 if mode == "silent" else ctx.task["turns"]
        for turn in range(1, num_turns + 1):
            reply = await ctx.chat(messages=messages, max_tokens=4)
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"].get("content") or ""})
            messages.append({"role": "user", "content": await self.tool.call({"n": turn}, ctx)})
        ctx.state["truncated"] = True  # the episode ends at its turn limit
        if mode == "raise":
            raise RuntimeError("the game server is down")
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "board":
            ctx.state["board"] = Board()


def tallied(state: dict[str, Any]) -> float:
    return state.get("tally", 0) / 10


def well_formed(task: dict[str, Any]) -> Any:
    return "nope" if task["mode"] == "bad_reward" else 1.0


async def judged(task: dict[str, Any]) -> float:
    if task["mode"] == "slow_reward":
        await asyncio.Event().wait()
    return 0.5


def num_messages(messages: list[dict[str, Any]]) -> float:
    return float(len(messages))


def first_of_group(tasks: list[dict[str, Any]]) -> list[float]:
    return [1.0] + [0.0] * (len(tasks) - 1)


def load_environment(turns: int = 2) -> Environment:
    return Environment(
        name="parity_env",
        tasks=TaskSet.from_rows([{"mode": mode, "turns": turns} for mode in MODES], schema={"mode": str, "turns": int}),
        prompt=lambda task: f"play {task['mode']}",
        harness=TurnsHarness(),
        rewards=[Reward(tallied), Reward(well_formed, weight=0.5), Reward(judged), Metric(num_messages),
                 GroupReward(first_of_group, weight=0.25)],
    )
