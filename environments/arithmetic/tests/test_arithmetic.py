"""arithmetic: the task set, the verifier on good, wrong and malformed answers, the group
reward, and one rollout through the chat harness against a scripted model."""

from __future__ import annotations

from fractions import Fraction

import pytest

import arithmetic
from flywheel.sdk.environment import EnvironmentLoadError, load_environment
from tests.scripted_openai import ScriptedOpenAI, ScriptEntry, make_rollout, run_rollout

TASK = {"question": "12 + 30 / 6", "answer": "17", "difficulty": "medium"}


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_tasks_are_reproducible_integer_problems(difficulty: str) -> None:
    env = arithmetic.load_environment(difficulty=difficulty)
    rows = env.load_tasks(200, seed=3)
    assert rows == env.load_tasks(200, seed=3) and rows != env.load_tasks(200, seed=4)
    for row in rows:
        env.check_task(row)
        assert row["difficulty"] == difficulty
        assert arithmetic.evaluate(row["question"]) == Fraction(int(row["answer"]))
        assert Fraction(eval(row["question"])) == Fraction(int(row["answer"]))
    assert [m.role for m in env.prompt_messages(rows[0])] == ["system", "user"]
    assert arithmetic.is_correct(env.reference_answer(rows[0]), rows[0])


def test_the_instructions_can_be_replaced() -> None:
    env = arithmetic.load_environment(system_prompt="Reply with Answer: and the integer.")
    task = env.load_tasks(1)[0]
    system, user = env.prompt_messages(task)
    assert (system.role, system.content) == ("system", "Reply with Answer: and the integer.")
    assert user.content == f"What is {task['question']}?"
    assert arithmetic.load_environment().prompt_messages(task)[0].content == arithmetic.SYSTEM_PROMPT


def test_bad_arguments_and_rows_are_refused() -> None:
    with pytest.raises(EnvironmentLoadError, match="difficulty='impossible'"):
        arithmetic.load_environment(difficulty="impossible")
    with pytest.raises(EnvironmentLoadError, match="missing field 'answer'"):
        arithmetic.load_environment().check_task({"question": "1 + 1", "difficulty": "easy"})


@pytest.mark.parametrize(("reply", "expected"), [
    ("12 + 5 = 17\nAnswer: 17", 17),
    ("**Answer:** 17", 17),
    ("The answer is `17`.", 17),
    ("\\boxed{17}", 17),
    ("Answer: 17.0", 17),
    ("Answer: 1,234", 1234),
    ("Answer: \N{MINUS SIGN}8", -8),
    ("answer = - 8", -8),
    ("Answer: 16\nOops, Answer: 17", 17),
    ("30 / 6 is 5, so 17", 17),
    ("I cannot solve this.", None),
    ("", None),
    ("Answer: seventeen", None),
])
def test_parse_answer(reply: str, expected: int | None) -> None:
    assert arithmetic.parse_answer(reply) == (None if expected is None else Fraction(expected))


async def test_rewards_on_hand_made_rollouts() -> None:
    env = arithmetic.load_environment()
    reward, formatted = env.rollout_rewards["correct"], env.rollout_rewards["formatted"]

    def rollout(answer: str):
        return make_rollout("arithmetic", TASK, [{"role": "user", "content": "What is 12 + 30 / 6?"},
                                                {"role": "assistant", "content": answer}])

    assert (await reward(rollout("Answer: 17"))).value == 1.0
    assert (await formatted(rollout("Answer: 17"))).value == 1.0
    assert (await reward(rollout("Answer: 7"))).value == 0.0  # (12 + 30) / 6: wrong order of operations
    assert (await reward(rollout("no idea"))).value == 0.0
    assert (await formatted(rollout("17"))).value == 0.0
    assert (await reward(rollout("17"))).value == 1.0  # the last number still counts when the line is missing
    closeness = env.rollout_rewards["closeness"]
    assert (await closeness(rollout("Answer: 17"))).value == 1.0
    assert (await closeness(rollout("Answer: 12"))).value == pytest.approx(1 - 5 / 27)
    assert (await closeness(rollout("Answer: -40"))).value == 0.0  # further off than |17| + 10
    assert (await closeness(rollout("no idea"))).value == 0.0
    assert env.weights == {"correct": 1.0, "shortest_correct": 0.1, "formatted": 0.0, "chars": 0.0, "closeness": 0.0}


async def test_shortest_correct_rewards_only_the_shortest_correct_reply() -> None:
    env = arithmetic.load_environment()
    replies = ["30 / 6 = 5 and 12 + 5 = 17.\nAnswer: 17", "Answer: 17", "Answer: 7", "Answer: 17 "]
    rollouts = [make_rollout("arithmetic", TASK, [{"role": "assistant", "content": r}], index=i)
                for i, r in enumerate(replies)]
    values = await env.group_rewards["shortest_correct"](rollouts)
    assert [v.value for v in values] == [0.0, 1.0, 0.0, 0.0]
    none_right = await env.group_rewards["shortest_correct"](rollouts[2:3])
    assert [v.value for v in none_right] == [0.0]


async def test_a_rollout_against_a_scripted_model() -> None:
    env = load_environment("arithmetic")
    script: list[ScriptEntry] = ["12 + 5 = 17\nAnswer: 17",
                                 {"content": "Let me think step by step about", "finish_reason": "length"}]
    with ScriptedOpenAI({"agent": script}) as server:
        solved = await run_rollout(env, TASK, server)
        asked = server.requests_for("agent")[0]["messages"]
        assert asked[0]["role"] == "system" and asked[1] == {"role": "user", "content": "What is 12 + 30 / 6?"}
        truncated = await run_rollout(env, TASK, server)
    assert solved.state["stop_reason"] == "done" and solved.state["turns"] == 1
    assert (await env.rollout_rewards["correct"](solved)).value == 1.0
    assert truncated.state["truncated"] is True
    assert (await env.rollout_rewards["correct"](truncated)).value == 0.0
