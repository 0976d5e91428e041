"""coding against a real sandbox service (local backend) over a real nats-server: every task's
reference solution passes its hidden tests and a trivial answer does not; rollouts through the
chat harness and a scripted model (a correct answer after trying code with the python tool, a
wrong one, one that loops forever, one that does not parse); the sandbox is gone afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import coding
from flywheel.contract import events
from flywheel.sdk import sandbox_tools
from flywheel.sdk.environment import EnvironmentLoadError
from flywheel.sdk.sandbox_tools import SandboxUnavailable, run_tests, use_client
from tests.sandbox_fixtures import sandboxed_rollout
from tests.sandbox_service import ServedSandboxClient
from tests.scripted_openai import make_rollout, tool_call


@pytest.fixture(scope="module")
def env():
    return coding.load_environment(partial_credit=0.25)


@pytest.fixture(scope="module")
def tasks(env) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in env.load_tasks(env.tasks.size)}


def answer(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\nIt handles the edge cases."


@pytest.mark.long
async def test_every_reference_solution_passes_and_a_stub_does_not(tasks, sandbox: ServedSandboxClient) -> None:
    assert 20 <= len(tasks) <= 40
    slots = asyncio.Semaphore(4)

    async def check(task: dict[str, Any]) -> tuple[str, Any, Any]:
        async with slots:
            good = await run_tests({"solution.py": task["solution"], "test_solution.py": task["tests"]},
                                   client=sandbox, timeout_s=60)
            stub = await run_tests({"solution.py": f"def {task['entry_point']}(*args, **kwargs):\n    return None\n"
                                                   f"{task['entry_point']} = {task['entry_point']}\n",
                                    "test_solution.py": task["tests"]}, client=sandbox, timeout_s=60)
        return task["id"], good, stub

    for task_id, good, stub in await asyncio.gather(*(check(t) for t in tasks.values())):
        assert good.all_passed and good.num_tests >= 4, (task_id, good.failures, good.output)
        assert not stub.all_passed, task_id
    assert not sandbox.manager.sessions


def test_prompts_hide_the_tests(env, tasks) -> None:
    for task in tasks.values():
        env.check_task(task)
        shown = " ".join(m.content for m in env.prompt_messages(task))
        assert task["entry_point"] in shown and "def test_" not in shown and task["solution"] not in shown


@pytest.mark.parametrize(("reply", "code"), [
    ("```python\nx = 1\n```", "x = 1\n"),
    ("first\n```py\na = 1\n```\nthen\n```\nb = 2\n```", "b = 2\n"),  # the last block counts
    ("```Python3\nc = 3\n```", "c = 3\n"),
    ("def f(): pass", None),
    ("```python\nunclosed", None),
])
def test_extract_code(reply: str, code: str | None) -> None:
    assert coding.extract_code(reply) == code


def test_syntax_errors_are_named() -> None:
    assert coding.syntax_error("def f(:\n") == "line 1: invalid syntax"
    null_bytes = coding.syntax_error("x = 1\x00")
    assert null_bytes is not None and "null bytes" in null_bytes
    assert coding.syntax_error("x = (" * 1000 + ")" * 1000) is not None
    assert coding.syntax_error("x = 1") is None
    with pytest.raises(EnvironmentLoadError, match="partial_credit"):
        coding.load_environment(partial_credit=2)


async def scores(env, rollout: events.Rollout) -> dict[str, Any]:
    out = {}
    for name, reward in env.rollout_rewards.items():
        value = await reward(rollout)
        out[name] = (value.value, value.components) if value.components else value.value
    return out


async def test_rollouts_are_rewarded_by_the_hidden_tests(env, tasks, sandbox: ServedSandboxClient) -> None:
    task = tasks["run-length-encode"]
    trial = tool_call("python", code=task["solution"] + "print(rle('aaab'))\n")
    rollout, server = await sandboxed_rollout(env, task, [trial, answer(task["solution"])], sandbox)
    said = [m["content"] for m in server.conversation("agent") if m["role"] == "tool"]
    assert said == ["exit code 0\n--- stdout ---\n3a1b"]
    assert [t["function"]["name"] for t in server.requests_for("agent")[0]["tools"]] == ["python"]
    assert not sandbox.manager.sessions  # the tool's session ended with the rollout
    with use_client(sandbox):
        assert await scores(env, rollout) == {"tests": (1.0, {"all_passed": 1.0, "fraction": 1.0}),
                                              "syntax_error": 0.0, "no_code": 0.0, "timed_out": 0.0,
                                              "python_calls": 1.0}
        wrong = await sandboxed_rollout(env, task, [answer("def rle(s):\n    return ''.join('1' + c for c in s)\n")],
                                        sandbox)
        result = await scores(env, wrong[0])
        assert result["tests"] == (pytest.approx(0.25 * 2 / 5), {"all_passed": 0.0, "fraction": 0.4})
        looping = await sandboxed_rollout(env, task, [answer("def rle(s):\n    while True:\n        pass\n")], sandbox)
        slow = coding.load_environment(test_timeout_s=0.2)
        result = await scores(slow, looping[0])
        assert result["tests"] == (0.0, {"all_passed": 0.0, "fraction": 0.0}) and result["timed_out"] == 1.0
        broken = await sandboxed_rollout(env, task, [answer("def rle(s)\n    return s\n")], sandbox)
        assert await scores(env, broken[0]) == {"tests": (0.0, {"all_passed": 0.0, "fraction": 0.0}),
                                                 "syntax_error": 1.0, "no_code": 0.0, "timed_out": 0.0,
                                                 "python_calls": 0.0}
        prose = await sandboxed_rollout(env, task, ["I would use itertools.groupby."], sandbox)
        assert (await scores(env, prose[0]))["no_code"] == 1.0
        huge = await sandboxed_rollout(env, task, [answer(task["solution"] + "#" * 600_000 + "\n")], sandbox)
        assert (await scores(env, huge[0]))["tests"] == (0.0, {"all_passed": 0.0, "fraction": 0.0})
    assert not sandbox.manager.sessions


async def test_one_test_run_serves_a_rollouts_rewards(tasks, sandbox: ServedSandboxClient) -> None:
    verifier = coding.Verifier(coding.SandboxSpec(), timeout_s=30, test_timeout_s=5)
    task = tasks["fizzbuzz"]
    with use_client(sandbox):
        first, second = await asyncio.gather(verifier.report(task["solution"], task),
                                             verifier.report(task["solution"], task))
    assert first is second and first.all_passed and len(verifier._runs) == 1


async def test_a_reward_without_a_sandbox_service_is_an_error_not_a_zero(env, tasks) -> None:
    task = tasks["fizzbuzz"]
    rollout = make_rollout("coding", task, [{"role": "assistant", "content": answer(task["solution"])}])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLYWHEEL_NATS_URL", "nats://127.0.0.1:1")
        mp.setattr(sandbox_tools, "CONNECT_TIMEOUT_S", 0.2)
        with pytest.raises(SandboxUnavailable, match="start the sandbox service"):
            await env.rollout_rewards["tests"](rollout)
