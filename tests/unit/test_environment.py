"""Loading environments, and rewards that misbehave."""

from __future__ import annotations

import sys
import types

import pytest

from flywheel import events
from flywheel.environment import EnvironmentLoadError, load_environment, make_reward


def rollout(answer: str, text: str = "abc") -> events.Rollout:
    nodes = [events.Node(id="u", message=events.Message(role="user", content=text)),
             events.Node(id="a", parent_id="u", message=events.Message(role="assistant", content=answer))]
    return events.Rollout(run="r", env="reverse_text", task_id="t", group_id="t", task_data={"text": text}, nodes=nodes)


async def test_reverse_text_rewards() -> None:
    env = load_environment("reverse_text")
    assert await env.rewards["similarity"](rollout("cba")) == 1.0
    assert 0 < await env.rewards["similarity"](rollout("cb")) < 1
    assert await env.rewards["exact"](rollout("abc")) == 0.0
    rows = env.load_tasks(5, seed=1)
    assert rows == env.load_tasks(5, seed=1) and env.reference(rows[0]) == rows[0]["text"][::-1]
    assert [m.role for m in env.prompt(rows[0])] == ["system", "user"]


def install(name: str, **attrs: object) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


@pytest.mark.parametrize(("attrs", "message"), [
    ({"prompt": lambda t: [], "REWARDS": {}}, "defines no load_tasks"),
    ({"load_tasks": lambda n, s: [], "prompt": lambda t: [], "REWARDS": {}}, "defines no rewards"),
    ({"load_tasks": lambda n, s: [], "prompt": lambda t: [], "REWARDS": {"x": lambda c: 1.0}}, "(function, weight)"),
])
def test_bad_environments_fail_at_load(attrs: dict, message: str) -> None:
    install("bad_env_under_test", **attrs)
    try:
        with pytest.raises(EnvironmentLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_environment("bad_env_under_test")
    finally:
        del sys.modules["bad_env_under_test"]
    with pytest.raises(EnvironmentLoadError, match="no module"):
        load_environment("no_such_environment_anywhere")


async def test_rewards_take_parameters_by_name_and_must_return_numbers() -> None:
    with pytest.raises(EnvironmentLoadError, match="answer"):
        make_reward("r", lambda answer: 1.0, 1.0)

    async def by_rollout(rollout: events.Rollout) -> float:
        return float(len(rollout.nodes))

    assert await make_reward("n", by_rollout, 1.0)(rollout("x")) == 2.0
    with pytest.raises(TypeError, match="returned 'yes'"):
        await make_reward("s", lambda completion: "yes", 1.0)(rollout("x"))
    with pytest.raises(TypeError, match="returned nan"):
        await make_reward("n", lambda: float("nan"), 1.0)(rollout("x"))


async def test_the_environment_turn_is_optional_and_awaited() -> None:
    calls: list[tuple[str, int]] = []

    async def step(task: dict, completion: str, index: int) -> None:
        calls.append((completion, index))

    base = {"load_tasks": lambda n, s: [], "prompt": lambda t: [], "REWARDS": {"x": (lambda completion: 1.0, 1.0)}}
    install("env_with_a_turn", **base, step=step)
    install("env_without_a_turn", **base)
    try:
        await load_environment("env_with_a_turn").step({}, "cba", 3)
        await load_environment("env_without_a_turn").step({}, "cba", 3)
    finally:
        del sys.modules["env_with_a_turn"], sys.modules["env_without_a_turn"]
    assert calls == [("cba", 3)]
