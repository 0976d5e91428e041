"""Environments, in their first form: a module with a task set, a prompt and rewards.

An environment module (found by its import name, e.g. ``reverse_text``) defines:

``load_tasks(num_tasks: int, seed: int) -> list[dict]``
    rows of the task set (JSON objects).
``prompt(task: dict) -> list[dict]``
    the chat messages the model sees, OpenAI shape (``{"role": ..., "content": ...}``).
``REWARDS: dict[str, tuple[callable, float]]``
    scorer name -> (reward function, default weight). A reward function takes any of the
    parameters ``completion`` (the model's final answer, str), ``task`` (the row, dict) and
    ``rollout`` (the :class:`flywheel.events.Rollout`), by name, and returns a float.
    It may be ``async``.
``reference(task: dict) -> str`` (optional)
    the reference answer, for supervised warm-up.
``async step(task: dict, completion: str, index: int) -> None`` (optional)
    the environment's turn after the model answered (a tool call, a sandbox run, a user
    simulator), awaited while the rollout holds its inference slot; ``index`` is the
    rollout's place in its group.

The same module serves evaluation and training. Single-turn only here: the model answers
once, then the environment may take its turn. Not covered: tools, multi-turn harnesses
(the model does not see the environment's turn), group rewards, task-row schemas.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from flywheel import events

REWARD_PARAMETERS = ("completion", "task", "rollout")


class EnvironmentLoadError(ValueError):
    """An environment that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable[..., Any]
    weight: float
    parameters: tuple[str, ...]

    async def __call__(self, rollout: events.Rollout) -> float:
        available = {"completion": completion_of(rollout), "task": rollout.task_data, "rollout": rollout}
        value = self.fn(**{p: available[p] for p in self.parameters})
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(f"reward {self.name!r} returned {value!r}; a reward returns a finite float")
        return float(value)


@dataclass(frozen=True)
class Environment:
    name: str
    module: ModuleType
    rewards: dict[str, Reward]

    def load_tasks(self, num_tasks: int, seed: int = 0) -> list[dict[str, Any]]:
        rows = self.module.load_tasks(num_tasks, seed)
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise EnvironmentLoadError(f"{self.name}.load_tasks: row {i} is a {type(row).__name__}, not a dict")
        return rows

    def prompt(self, task: dict[str, Any]) -> list[events.Message]:
        return [events.Message(role=m["role"], content=m["content"]) for m in self.module.prompt(task)]

    async def step(self, task: dict[str, Any], completion: str, index: int) -> None:
        fn = getattr(self.module, "step", None)
        if fn is not None:
            await fn(task, completion, index)

    def reference(self, task: dict[str, Any]) -> str:
        if not hasattr(self.module, "reference"):
            raise EnvironmentLoadError(f"environment {self.name!r} defines no reference(task): it cannot be used for SFT")
        return self.module.reference(task)


def completion_of(rollout: events.Rollout) -> str:
    """The rollout's final answer: the content of its last assistant node."""
    for node in reversed(rollout.nodes):
        if node.message.role == "assistant":
            return node.message.content
    return ""


def load_environment(name: str) -> Environment:
    """Import the environment module ``name`` and check it; errors name what to fix."""
    module_name = name.replace("-", "_")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise EnvironmentLoadError(f"environment {name!r}: no module {module_name!r} ({exc}); install its package "
                                "or put it on PYTHONPATH") from exc
    for attr in ("load_tasks", "prompt", "REWARDS"):
        if not hasattr(module, attr):
            raise EnvironmentLoadError(f"environment {name!r} ({getattr(module, '__file__', module_name)}) defines no {attr}")
    rewards = {}
    for reward_name, spec in module.REWARDS.items():
        if not (isinstance(spec, tuple) and len(spec) == 2 and callable(spec[0])):
            raise EnvironmentLoadError(f"environment {name!r}: REWARDS[{reward_name!r}] must be (function, weight)")
        rewards[reward_name] = make_reward(reward_name, spec[0], float(spec[1]))
    if not rewards:
        raise EnvironmentLoadError(f"environment {name!r} defines no rewards: REWARDS is empty")
    return Environment(name=module_name, module=module, rewards=rewards)


def make_reward(name: str, fn: Callable[..., Any], weight: float) -> Reward:
    params = tuple(inspect.signature(fn).parameters)
    unknown = [p for p in params if p not in REWARD_PARAMETERS]
    if unknown:
        raise EnvironmentLoadError(f"reward {name!r} ({fn.__qualname__}) takes {unknown}; a reward takes any of "
                                f"{', '.join(REWARD_PARAMETERS)} by name")
    return Reward(name=name, fn=fn, weight=weight, parameters=params)
