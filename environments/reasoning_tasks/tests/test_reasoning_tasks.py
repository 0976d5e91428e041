"""reasoning_tasks: reasoning-gym's tasks by name with their own config, the held-out split on
other seeds, its own scorer on right, wrong and unformatted answers, the errors that name a bad
task, setting or split, and the one a missing extra gives."""

from __future__ import annotations

import re
import sys

import pytest
import reasoning_gym

import reasoning_tasks
from flywheel.sdk.environment import EnvironmentLoadError, EnvironmentOverrides, load_environment
from tests.scripted_openai import ScriptedOpenAI, make_rollout, run_rollout

LEGS = {"min_animals": 2, "max_animals": 2, "min_instances": 1, "max_instances": 3}


def rollout(task: dict, answer: str):
    return make_rollout("reasoning_tasks", task, [{"role": "user", "content": task["question"]},
                                                  {"role": "assistant", "content": answer}])


async def rewards(env, task: dict, answer: str) -> dict[str, float]:
    return {name: (await reward(rollout(task, answer))).value for name, reward in env.rollout_rewards.items()}


@pytest.mark.parametrize(("task", "config"), [("leg_counting", LEGS),
                                              ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                                    "max_digits": 1})])
def test_a_task_by_name_with_its_own_config(task: str, config: dict) -> None:
    env = reasoning_tasks.load_environment(task=task, config=config)
    rows = env.load_tasks(20, seed=3)
    assert rows == env.load_tasks(20, seed=3) and rows != env.load_tasks(20, seed=4)
    # What reasoning-gym itself generates for that seed and config: the config is passed through.
    theirs = reasoning_gym.create_dataset(task, seed=rows[0]["seed"], size=20, **config)
    assert [r["question"] for r in rows] == [theirs[i]["question"] for i in range(20)]
    assert [r["answer"] for r in rows] == [theirs[i]["answer"] for i in range(20)]
    for row in rows:
        env.check_task(row)
        assert row["task"] == task
    if task == "leg_counting":  # two kinds of animal, at most three of each: the config took
        assert all(theirs[i]["metadata"]["num_animals"] == 2 for i in range(20))
    else:
        assert all(len(r["question"].split("=")[0].split()) <= 10 for r in rows)
    system, user = env.prompt_messages(rows[0])
    assert system.role == "system" and "<answer>" in system.content and user.content == rows[0]["question"]
    assert env.reference_answer(rows[0]) == f"<answer>{rows[0]['answer']}</answer>"
    assert env.weights == {"score": 1.0, "format": 0.0, "correct": 0.0}


def test_the_held_out_split_is_on_other_seeds() -> None:
    train = reasoning_tasks.load_environment(task="basic_arithmetic")
    test = reasoning_tasks.load_environment(task="basic_arithmetic", split="test")
    seen: dict[str, set[int]] = {"train": set(), "test": set()}
    questions: dict[str, set[str]] = {"train": set(), "test": set()}
    for split, env in (("train", train), ("test", test)):
        for seed in (0, 1, 2047, 2048, -1):
            for row in env.load_tasks(50, seed=seed):
                seen[split].add(row["seed"] + row["index"])  # reasoning-gym draws item i from Random(seed + i)
                questions[split].add(row["question"])
    assert not seen["train"] & seen["test"] and not questions["train"] & questions["test"]
    assert max(seen["train"]) < 2**31 <= min(seen["test"]) and max(seen["test"]) < 2**32
    # Run seeds a window apart: 0 and 1 share no task; 2048 is 0 again.
    assert {r["question"] for r in train.load_tasks(50, seed=0)}.isdisjoint(
        r["question"] for r in train.load_tasks(50, seed=1))
    assert train.load_tasks(5, seed=2048) == train.load_tasks(5, seed=0)
    assert reasoning_tasks.first_seed("train", 2047) + reasoning_tasks.WINDOW == 2**31
    assert reasoning_tasks.first_seed("test", 0) == 2**31


async def test_its_own_scorer_on_right_wrong_and_unformatted_answers() -> None:
    env = reasoning_tasks.load_environment(task="leg_counting", config=LEGS)
    task = env.load_tasks(1, seed=0)[0]
    right = task["answer"]
    wrong = str(int(right) + 1)
    assert await rewards(env, task, f"Let me count.\n<answer>{right}</answer>") == {
        "score": 1.0, "format": 1.0, "correct": 1.0}
    assert await rewards(env, task, f"<answer> {right} </answer>") == {"score": 1.0, "format": 1.0, "correct": 1.0}
    assert await rewards(env, task, f"<answer>{wrong}</answer>") == {"score": 0.0, "format": 1.0, "correct": 0.0}
    # The last answer tags count.
    assert (await rewards(env, task, f"<answer>{wrong}</answer> no: <answer>{right}</answer>"))["correct"] == 1.0
    assert await rewards(env, task, f"The answer is {right}.") == {"score": 0.0, "format": 0.0, "correct": 0.0}
    assert await rewards(env, task, "<answer></answer>") == {"score": 0.0, "format": 0.0, "correct": 0.0}
    assert await rewards(env, task, f"<answer>{right}") == {"score": 0.0, "format": 0.0, "correct": 0.0}


async def test_partial_credit_is_reasoning_gyms() -> None:
    # basic_arithmetic has no scorer of its own: reasoning-gym's default gives len(answer) / len(reply)
    # to a reply that holds the answer.
    env = reasoning_tasks.load_environment(task="basic_arithmetic")
    task = env.load_tasks(1, seed=0)[0]
    got = await rewards(env, task, f"<answer>{task['answer']} !</answer>")
    assert 0 < got["score"] < 1 and got["correct"] == 0.0 and got["format"] == 1.0


async def test_a_composite_mixes_tasks_each_with_its_config() -> None:
    parts = [{"name": "leg_counting", "weight": 1, "config": LEGS}, {"name": "basic_arithmetic", "weight": 3}]
    env = reasoning_tasks.load_environment(task="composite", config={"datasets": parts})
    rows = env.load_tasks(40, seed=0)
    legs = [r for r in rows if "legs" in r["question"]]
    assert 0 < len(legs) < 20  # about one in four
    for row in rows:
        assert row["task"] == "composite"
        assert (await rewards(env, row, f"<answer>{row['answer']}</answer>"))["correct"] == 1.0
    with pytest.raises(EnvironmentLoadError, match=r"config.datasets\[1\].config key\(s\) 'legs' are not settings of "
                                                   "'basic_arithmetic'"):
        reasoning_tasks.load_environment(task="composite", config={"datasets": [parts[0], {
            "name": "basic_arithmetic", "config": {"legs": 2}}]})
    with pytest.raises(EnvironmentLoadError, match=r"config.datasets\[0\].config sets seed"):
        reasoning_tasks.load_environment(task="composite",
                                         config={"datasets": [{"name": "gcd", "config": {"seed": 1}}]})


async def test_a_row_of_another_config_is_an_error_not_a_zero() -> None:
    env = reasoning_tasks.load_environment(task="leg_counting", config=LEGS)
    row = reasoning_tasks.load_environment(task="leg_counting").load_tasks(1, seed=0)[0]
    with pytest.raises(ValueError, match="another question for leg_counting"):
        await env.rollout_rewards["score"](rollout(row, f"<answer>{row['answer']}</answer>"))
    other = reasoning_tasks.load_environment(task="basic_arithmetic").load_tasks(1)[0]
    with pytest.raises(ValueError, match="task 'basic_arithmetic' scored by the 'leg_counting' environment"):
        await env.rollout_rewards["score"](rollout(other, "<answer>1</answer>"))


def test_bad_names_settings_and_splits_are_refused_with_the_valid_ones() -> None:
    with pytest.raises(EnvironmentLoadError, match=r"task='leg_countin' is not a reasoning-gym .* task \(did you "
                                                   r"mean 'leg_counting'.*the tasks: ab, acre, .*zebra_puzzles"):
        reasoning_tasks.load_environment(task="leg_countin")
    with pytest.raises(EnvironmentLoadError, match=r"config key\(s\) 'legs' are not settings of 'leg_counting'; its "
                                                   r"settings: min_animals \(default 3\), max_animals"):
        reasoning_tasks.load_environment(task="leg_counting", config={"legs": 4})
    with pytest.raises(EnvironmentLoadError, match=re.escape(
            "leg_counting with config {'min_animals': 0}: min_animals must be")):
        reasoning_tasks.load_environment(task="leg_counting", config={"min_animals": 0})
    with pytest.raises(EnvironmentLoadError, match="config sets seed, size; the split and the run's task seed"):
        reasoning_tasks.load_environment(config={"seed": 1, "size": 10})
    with pytest.raises(EnvironmentLoadError, match="split='dev'; use one of train, test"):
        reasoning_tasks.load_environment(split="dev")
    with pytest.raises(EnvironmentLoadError, match="has no single answer"):  # boxnet's scorer checks a plan
        env = reasoning_tasks.load_environment(task="boxnet")
        env.reference_answer(env.load_tasks(1)[0])


def test_without_the_extra_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ModuleNotFoundError
    with pytest.raises(EnvironmentLoadError, match=r"pip install 'flywheel-rl\[reasoning\]'"):
        reasoning_tasks.load_environment()


async def test_a_rollout_against_a_scripted_model() -> None:
    env = load_environment("reasoning_tasks", EnvironmentOverrides(args={
        "task": "leg_counting", "config": LEGS, "split": "test", "system_prompt": "direct"}))
    task = env.load_tasks(1, seed=7)[0]
    with ScriptedOpenAI({"agent": [f"<answer>{task['answer']}</answer>"]}) as server:
        solved = await run_rollout(env, task, server)
        asked = server.requests_for("agent")[0]["messages"]
    assert asked[0] == {"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["direct"]}
    assert asked[1] == {"role": "user", "content": task["question"]}
    assert (await env.rollout_rewards["score"](solved)).value == 1.0
