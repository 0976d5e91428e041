"""The environment SDK without a bus: finding environments by id, loading them, rewards and
group rewards as functions, run-config overrides, and bad environments (no reward, a reward
returning a non-number or raising, a row that does not fit the schema), each with a clear
error. How the scorer records reward errors on a rollout is in tests/unit/test_scorer_rewards.py.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.config import RunConfig
from flywheel.sdk.environment import (
    Environment,
    EnvironmentLoadError,
    EnvironmentOverrides,
    GroupReward,
    Metric,
    Reward,
    RewardError,
    RewardOverride,
    TaskSet,
    Value,
    available,
    load_environment,
    other_ids,
    overrides_of,
    resolve,
    shortest_correct_reward,
)
from flywheel.sdk.tracegraph import rollout_from_messages
from tests.helpers import num_tasks


def rollout(answer: str, text: str = "abc", index: int = 0, state: dict | None = None) -> events.Rollout:
    messages = [events.Message(role="user", content=text), events.Message(role="assistant", content=answer)]
    return rollout_from_messages(run="r", env="reverse_text", task_id="t", task_data={"text": text},
                                 messages=messages, index=index, state=state)


class EnvUnderTest(types.ModuleType):
    """The module ``env_under_test``: the test sets its ``load_environment`` (or leaves it out)."""

    load_environment: Callable[..., object]


@pytest.fixture
def module() -> Iterator[EnvUnderTest]:
    """A module ``env_under_test`` on sys.modules for the test to fill in."""
    mod = EnvUnderTest("env_under_test")
    sys.modules[mod.__name__] = mod
    try:
        yield mod
    finally:
        del sys.modules[mod.__name__]


async def test_reverse_text_by_module_name_and_by_id() -> None:
    env = load_environment("reverse_text")
    assert load_environment("flywheel/reverse-text").weights == env.weights == {"similarity": 1.0, "exact": 0.0}
    assert load_environment("flywheel/reverse-text@0.1.0").name == "reverse_text"
    assert available()["flywheel/reverse-text"] == "0.1.0"
    assert other_ids("flywheel/reverse-text") == ["reverse_text"] and other_ids("reverse_text") == [
        "flywheel/reverse-text"]
    assert other_ids("flywheel/reverse-text@0.1.0") == other_ids("math") == []  # a version, or none installed
    similarity, exact = env.rewards
    assert isinstance(similarity, Reward) and isinstance(exact, Reward)
    assert await similarity(rollout("cba")) == Value(1.0)
    assert 0 < (await similarity(rollout("cb"))).value < 1
    assert await exact(rollout("abc")) == Value(0.0)
    rows = env.load_tasks(5, seed=1)
    assert rows == env.load_tasks(5, seed=1) and env.reference_answer(rows[0]) == rows[0]["text"][::-1]
    assert [m.role for m in env.prompt_messages(rows[0])] == ["system", "user"]


@pytest.mark.parametrize(("env_id", "message"), [
    ("flywheel/reverse-text@9.9", "version 0.1.0 is installed, not 9.9; install the wanted one"),
    ("nobody/nothing", "environment 'nobody/nothing' is not installed: no package registers 'nobody/nothing'"),
    ("no_such_environment_anywhere", "no module 'no_such_environment_anywhere'; install its package"),
])
def test_ids_that_do_not_resolve_say_why(env_id: str, message: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=message.replace("(", r"\(")):
        resolve(env_id)


def test_a_broken_module_shows_its_own_import_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_env_under_test.py").write_text("import a_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_missing"):
        resolve("broken_env_under_test")


def good_reward(completion: str) -> float:
    return 1.0


@pytest.mark.parametrize(("load", "message"), [
    (None, "defines no load_environment(**args) -> Environment"),
    (lambda: {"name": "x"}, "load_environment returned a dict, not an Environment"),
    (lambda: Environment(name="x", tasks=[{"prompt": "p"}], rewards=[]), "defines no rewards: give at least one"),
    (lambda: Environment(name="x", tasks=[], rewards=[good_reward]), "task set 'x tasks' is empty"),
    (lambda: Environment(name="x", tasks=[{"prompt": "p"}], rewards=[lambda completion: 1.0]),
     "give it a name (Reward(fn, name=...))"),
    (lambda: Environment(name="x", tasks=[{"prompt": "p"}], rewards=[lambda answer: 1.0]), "give it a name"),
    (lambda: Environment(name="x", tasks=[{"prompt": "p"}], rewards=[Reward(lambda answer: 1.0, name="r")]),
     "reward 'r' (<lambda>.<locals>.<lambda>) takes ['answer']; a reward takes any of completion, messages"),
    (lambda: Environment(name="x", tasks=[{"prompt": "p"}], rewards=[Reward(good_reward, weight=-1)]),
     "reward 'good_reward': weight=-1; a weight is a finite number >= 0"),
    (lambda: Environment(name="x", tasks=[{"prompt": "p"}], rewards=[good_reward, Metric(good_reward)]),
     "reward names ['good_reward'] are used twice"),
    (lambda: Environment(name="x", tasks=[{"prompt": "p"}], rewards=[GroupReward(good_reward)]),
     "group reward 'good_reward' (good_reward) takes ['completion']; a group reward takes any of completions"),
])
def test_bad_environments_fail_at_load(module: EnvUnderTest, load: Callable[[], object] | None, message: str) -> None:
    if load is not None:
        module.load_environment = load
    with pytest.raises(EnvironmentLoadError) as err:
        load_environment("env_under_test")
    assert message in str(err.value)


def test_load_environment_arguments_are_checked(module: EnvUnderTest) -> None:
    def load(size: int = 1) -> Environment:
        return Environment(name="sized", tasks=[{"prompt": "p"}] * size, rewards=[good_reward])

    module.load_environment = load
    assert num_tasks(load_environment("env_under_test", EnvironmentOverrides(args={"size": 3}))) == 3
    with pytest.raises(EnvironmentLoadError, match=r"load_environment\(colour\) failed: .*unexpected keyword"):
        load_environment("env_under_test", EnvironmentOverrides(args={"colour": "red"}))


def test_task_rows_that_do_not_fit_the_schema_are_named() -> None:
    with pytest.raises(EnvironmentLoadError, match=r"task set 't', row 1: field 'text' is 3 \(int\); the schema "
                                                   r"wants str"):
        TaskSet.from_rows([{"text": "abc"}, {"text": 3}, {"other": "x"}], schema={"text": str}, name="t")
    generated = TaskSet.from_generator(lambda num, seed: [{"text": True}] * num, schema={"text": str})
    with pytest.raises(EnvironmentLoadError, match=r"row 0: field 'text' is True \(bool\); the schema wants str"):
        generated.rows(2)
    env = load_environment("reverse_text")
    with pytest.raises(EnvironmentLoadError, match=r"environment 'reverse_text': task: missing field 'text' "
                                                   r"\(schema: text: str\)"):
        env.check_task({"txt": "abc"})
    with pytest.raises(EnvironmentLoadError, match="task: a list, not a JSON object"):
        env.check_task(["abc"])


async def test_rewards_take_parameters_by_name_and_must_return_numbers() -> None:
    async def by_rollout(rollout: events.Rollout, state: dict) -> float:
        return float(len(rollout.nodes) + state["bonus"])

    assert await Reward(by_rollout)(rollout("x", state={"bonus": 1})) == Value(3.0)
    parts = Reward(lambda completion: {"length": len(completion), "right": 1.0}, name="parts", weights={"length": 0.5})
    assert await parts(rollout("abcd")) == Value(3.0, {"length": 4.0, "right": 1.0})
    for fn, shown in ((lambda completion: "yes", "'yes'"), (lambda: float("nan"), "nan"), (lambda: None, "None"),
                      (lambda: True, "True")):
        with pytest.raises(RewardError, match=f"reward 'bad' returned {shown}; a reward returns a finite float"):
            await Reward(fn, name="bad")(rollout("x"))

    def raises(task: dict) -> float:
        raise KeyError("answer")

    with pytest.raises(KeyError):  # propagates: the scorer records it on the rollout's Score
        await Reward(raises)(rollout("x"))


async def test_group_rewards_see_the_group_and_return_one_value_each() -> None:
    group = [rollout("cba", index=0), rollout("cbaa", index=1), rollout("cb", index=2), rollout("c b a", index=3)]
    shortest = shortest_correct_reward(lambda c, t: c.replace(" ", "") == t["text"][::-1])
    assert [v.value for v in await shortest(group)] == [1.0, 0.0, 0.0, 0.0]
    assert shortest.weight == 0.1 and shortest.name == "shortest_correct"
    wrong = GroupReward(lambda completions: [1.0], name="wrong")
    with pytest.raises(RewardError, match=r"group reward 'wrong' returned \[1.0\]; it returns a list with one value "
                                          r"per rollout \(4\)"):
        await wrong(group)
    with pytest.raises(RewardError, match="returned 'x'"):
        await GroupReward(lambda tasks: ["x"] * len(tasks), name="words")(group)


async def test_overrides_change_weights_swap_functions_and_add_rewards(module: types.ModuleType) -> None:
    env = load_environment("reverse_text")
    changed = env.with_overrides(EnvironmentOverrides(rewards={
        "exact": RewardOverride(weight=2.0),
        "similarity": RewardOverride(function="tests.unit.test_environment:good_reward"),
        "group": RewardOverride(function="tests.unit.test_scorer_rewards:shortest", group=True, weight=0.5)}))
    assert changed.weights == {"similarity": 1.0, "exact": 2.0, "group": 0.5}
    assert set(changed.group_rewards) == {"group"} and env.weights == {"similarity": 1.0, "exact": 0.0}
    assert await changed.rollout_rewards["similarity"](rollout("zzz")) == Value(1.0)
    for spec, message in ((RewardOverride(weight=1.0), ("rewards.nope: environment 'reverse_text' has no reward "
                                                        "'nope' (it has ['exact', 'similarity']); give `function`")),
                          (RewardOverride(function="tests.unit.test_environment:absent"),
                           ("rewards.nope.function='tests.unit.test_environment:absent': 'tests.unit.test_environment' "
                            "has no 'absent'"))):
        with pytest.raises(EnvironmentLoadError) as err:
            env.with_overrides(EnvironmentOverrides(rewards={"nope": spec}))
        assert message in str(err.value)
    by_run = load_environment("flywheel/reverse-text", overrides_of(RunConfig.parse(
        {"run": "r", "env": "flywheel/reverse-text", "rewards": {"exact": {"weight": 3}}}).environments[0]))
    assert by_run.weights == {"similarity": 1.0, "exact": 3.0}
