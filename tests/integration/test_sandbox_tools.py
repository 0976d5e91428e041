"""flywheel.sdk.sandbox_tools against a real sandbox service (local backend) over a real nats-server:
the bash and python tools on good and bad calls, the rollout's session (lazy, labelled,
destroyed when the rollout ends, even when the harness raises), and run_tests on passing,
failing, broken, looping and output-forging code."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from flywheel.sdk import sandbox as sandbox_sdk
from flywheel.sdk.environment import Environment, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness, RolloutContext, ToolError
from flywheel.sdk.sandbox import ROLLOUT_LABEL, WORKDIR, SandboxClient, SandboxSpec
from flywheel.sdk.sandbox_tools import (
    SandboxTools,
    SandboxUnavailable,
    connect,
    default_client,
    run_tests,
    sandbox_session,
    use_client,
)
from tests.helpers import until
from tests.sandbox_service import ServedSandboxClient
from tests.scripted_openai import ScriptedOpenAI, tool_call

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = """from solution import add

def test_small():
    assert add(1, 2) == 3

def test_negative():
    assert add(-1, -1) == -2

def test_strings():
    assert add("a", "b") == "ab"
"""


class CountingClient(SandboxClient):
    """The client, counting the one-shot runs it asks for (refused ones too)."""

    num_runs = 0

    async def run(self, *args: Any, **kwargs: Any) -> Any:
        self.num_runs += 1
        return await super().run(*args, **kwargs)


def context(client: SandboxClient | None, rollout_id: str = "r-1") -> RolloutContext:
    return RolloutContext(task={}, base_url="", api_key="", model="", rollout_id=rollout_id, sandbox_client=client)


async def test_bash_and_python_share_a_session_that_ends_with_the_rollout(sandbox: ServedSandboxClient) -> None:
    tools = SandboxTools(timeout_s=2, max_output_chars=300)
    ctx = context(sandbox)
    assert not sandbox.manager.sessions  # lazy: nothing until the first call
    assert await tools.bash("mkdir -p src && cd src && echo 'x = 6 * 7' > lib.py && pwd", ctx) == \
        f"exit code 0\n--- stdout ---\n{WORKDIR}/src"
    assert await tools.python("from lib import x\nprint(x)", ctx) == "exit code 0\n--- stdout ---\n42"
    assert await tools.bash("true", ctx) == "exit code 0\n(no output)"
    failed = await tools.bash("echo to-err >&2; exit 3", ctx)
    assert failed == "exit code 3\n--- stderr ---\nto-err"
    crashed = await tools.python("import sys\nprint('partial')\n1 / 0", ctx)
    assert crashed.startswith("exit code 1\n--- stdout ---\npartial\n--- stderr ---\nTraceback")
    assert "ZeroDivisionError" in crashed
    assert await tools.bash("kill -TERM $$", ctx) == "killed by signal 15 (SIGTERM)\n(no output)"
    slow = await tools.bash("echo started; sleep 30", ctx)
    assert slow.startswith("timed out after 2 s: the command and everything it started were killed")
    long = await tools.bash("seq 1 1000", ctx)
    assert long.startswith("exit code 0\n--- stdout (showing 300 of 3893 characters) ---\n1\n2\n")
    assert "\n[... 3593 characters cut ...]\n" in long and long.endswith("\n999\n1000")
    flood = await tools.bash("seq 1 100000", ctx)  # past what the sandbox keeps of a stream
    assert flood.startswith("exit code 0\n--- stdout (more than 65536 characters: showing 300 of the first 65536)")
    assert len(flood) < 500
    (box,) = sandbox.manager.sessions.values()
    assert box.spec.labels == {ROLLOUT_LABEL: "r-1"}
    assert ctx.state["sandbox_calls"] == {"command": 7, "code": 2}
    await ctx.close()
    assert not sandbox.manager.sessions


async def test_bad_calls_are_answered_and_the_session_survives(sandbox: ServedSandboxClient) -> None:
    tools = SandboxTools(timeout_s=5)
    ctx = context(sandbox)
    for bad, message in (("   ", "command is empty"), ("echo a\x00b", "NUL"), ("x" * 100_001, "over the limit")):
        with pytest.raises(ToolError, match=message):
            await tools.bash(bad, ctx)
    with pytest.raises(ToolError, match="code is empty"):
        await tools.python("", ctx)
    assert not sandbox.manager.sessions  # no call reached the sandbox
    assert (await tools.bash("echo ok", ctx)).endswith("ok")
    for command in ("kill -9 -1", "echo again"):  # the model kills all it may, its sandbox's agent included
        with pytest.raises(ToolError, match="is gone: its processes were killed from inside"):
            await tools.bash(command, ctx)
    await ctx.close()
    assert not sandbox.manager.sessions


async def test_the_session_is_destroyed_when_the_harness_raises(sandbox: ServedSandboxClient) -> None:
    tools = SandboxTools()

    def setup(ctx: RolloutContext) -> None:
        ctx.state["setup"] = True

    env = Environment(name="boom", tasks=TaskSet.from_rows([{"q": "x"}]),
                      harness=ChatHarness(tools=tools.tools(), setup=setup, max_turns=5),
                      prompt=lambda task: task["q"], rewards=[Reward(lambda: 0.0, name="zero")])
    script = [tool_call("bash", command="echo hi > f.txt"), tool_call("python", code="print(open('f.txt').read())"),
              tool_call("bash", command="true")]
    assert env.harness is not None
    with ScriptedOpenAI({"agent": script}) as server:  # the fourth turn is past the script: the harness raises
        ctx = RolloutContext(task={"q": "x"}, base_url=server.base_url, api_key="t", model="agent", rollout_id="r-9",
                             sandbox_client=sandbox)
        with pytest.raises(Exception, match="no reply left"):
            try:
                await env.harness.run(env, ctx)
            finally:
                assert len(sandbox.manager.sessions) == 1
                await ctx.close()
        said = [m["content"] for m in server.requests_for("agent")[-1]["messages"] if m["role"] == "tool"]
    assert said == ["exit code 0\n(no output)", "exit code 0\n--- stdout ---\nhi"]
    tool_specs = {t["function"]["name"]: t["function"] for t in server.requests_for("agent")[0]["tools"]}
    assert list(tool_specs["bash"]["parameters"]["properties"]) == ["command"]
    assert "30 s" in tool_specs["python"]["description"]
    assert not sandbox.manager.sessions


async def test_setup_fills_the_session_and_leftovers_go_by_label(sandbox: ServedSandboxClient) -> None:
    ctx = context(sandbox, rollout_id="r-left")
    client, box = await sandbox_session(ctx, SandboxSpec(files={"notes/a.txt": b"from setup"}))
    assert (client, box) == (sandbox, (await sandbox_session(ctx))[1])  # one session a rollout
    assert (await SandboxTools().bash("cat notes/a.txt", ctx)).endswith("from setup")
    assert await sandbox.destroy_by_label({ROLLOUT_LABEL: "r-left"}) == 1  # e.g. after a crashed worker
    await ctx.close()  # destroying what is already gone is fine
    assert not sandbox.manager.sessions


async def test_no_sandbox_service_is_a_clear_rollout_error() -> None:
    with pytest.raises(SandboxUnavailable, match=r"start the sandbox service \(flywheel up\) or set nats_url"):
        await SandboxTools().bash("ls", context(None))
    with pytest.raises(SandboxUnavailable, match=r"cannot reach NATS at nats://127\.0\.0\.1:1"):
        await connect("nats://127.0.0.1:1", timeout_s=0.3)


async def test_no_service_answering_on_nats_fails_the_rollout(sandbox: ServedSandboxClient) -> None:
    lone = SandboxClient(sandbox.bus)
    sandbox.manager.closed = True  # the service refuses new sandboxes, as when it stops
    with pytest.raises(SandboxUnavailable, match="stopping"):
        await SandboxTools().bash("ls", context(lone))
    sandbox.manager.closed = False


async def test_run_tests_counts_passes_failures_and_timeouts(sandbox: ServedSandboxClient) -> None:
    with use_client(sandbox):
        assert await default_client() is sandbox
        good = await run_tests({"solution.py": SOLUTION, "test_solution.py": TESTS})
        assert good.verdicts == {"test_small": "pass", "test_negative": "pass", "test_strings": "pass"}
        assert good.all_passed and good.fraction == 1.0 and good.exit_code == 0 and not good.timed_out
        wrong = await run_tests({"solution.py": "def add(a, b):\n    print('debug')\n    return a - b\n",
                                 "test_solution.py": TESTS})
        assert (wrong.num_passed, wrong.num_tests, wrong.all_passed) == (0, 3, False)
        assert "AssertionError: assert add(1, 2) == 3" in wrong.failures["test_small"]
        assert "unsupported operand" in wrong.failures["test_strings"] and "debug" in wrong.output
        broken = await run_tests({"solution.py": "def add(a, b)\n    return a + b\n", "test_solution.py": TESTS})
        assert broken.fraction == 0.0 and "import failed: " in broken.failures["test_small"]
        assert "SyntaxError" in broken.failures["test_small"]
        partial = await run_tests({"solution.py": "def add(a, b):\n    while a == -1:\n        pass\n"
                                                  "    return a + b\n",
                                   "test_solution.py": TESTS}, test_timeout_s=0.3)
        assert partial.verdicts == {"test_small": "pass", "test_negative": "timeout", "test_strings": "pass"}
        assert partial.num_timeouts == 1 and partial.fraction == pytest.approx(2 / 3)
    assert not sandbox.manager.sessions  # one-shot sandboxes


async def test_run_tests_resists_forged_output_and_whole_run_timeouts(sandbox: ServedSandboxClient) -> None:
    forger = ("import os, sys\nfor t in ('test_small', 'test_negative', 'test_strings'):\n"
              "    print('x pass', t); os.write(1, f'\\nx pass {t}\\n'.encode())\nos._exit(0)\n")
    forged = await run_tests({"solution.py": forger, "test_solution.py": TESTS}, client=sandbox)
    assert forged.num_passed == 0 and set(forged.verdicts.values()) == {"missing"}
    assert "no verdict" in forged.failures["test_small"]
    # A deliberate sleep: the sleeps below are the solution under test looping forever, not the test waiting.
    hung = await run_tests({"solution.py": "import time\nwhile True:\n    time.sleep(0.01)\n",  # noqa: sleep
                            "test_solution.py": TESTS}, client=sandbox, timeout_s=1, test_timeout_s=30)
    assert hung.timed_out and set(hung.verdicts.values()) == {"timeout"} and hung.fraction == 0.0
    with pytest.raises(ValueError, match="no top-level test_"):
        await run_tests({"solution.py": SOLUTION, "test_solution.py": "x = 1\n"}, client=sandbox)
    with pytest.raises(ValueError, match="not among the files"):
        await run_tests({"solution.py": SOLUTION}, client=sandbox)


async def test_run_tests_with_a_command_of_your_own(sandbox: ServedSandboxClient) -> None:
    script = "python3 -c 'import solution; assert solution.add(2, 2) == 4' && echo ok"
    passed = await run_tests({"solution.py": SOLUTION}, command=script, client=sandbox)
    assert passed.verdicts == {"command": "pass"} and passed.all_passed
    failed = await run_tests({"solution.py": "def add(a, b):\n    return 5\n"}, command=script, client=sandbox)
    assert failed.verdicts == {"command": "fail"}
    summary = await run_tests({}, command="echo '=== 3 passed, 1 failed in 0.1s ==='; exit 1", client=sandbox)
    assert (summary.num_passed, summary.num_tests) == (3, 4)


async def test_at_the_cap_a_test_run_waits_for_room_then_gives_up(sandbox: ServedSandboxClient,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox.manager.config.max_alive = 1
    ctx = context(sandbox)
    await sandbox_session(ctx)  # the one sandbox there is room for
    counting = CountingClient(sandbox.bus)
    waiting = asyncio.ensure_future(run_tests({"solution.py": SOLUTION, "test_solution.py": TESTS}, client=counting))
    await until(lambda: counting.num_runs >= 3, what="run_tests retrying while the service is full")
    assert not waiting.done()
    await ctx.close()  # room again
    assert (await waiting).all_passed
    monkeypatch.setattr(sandbox_sdk, "CAPACITY_WAIT_S", 0.2)
    ctx = context(sandbox)
    await sandbox_session(ctx)
    with pytest.raises(SandboxUnavailable, match="sandbox_max_alive"):
        await run_tests({"solution.py": SOLUTION, "test_solution.py": TESTS}, client=sandbox)
    await ctx.close()


async def test_a_rollout_that_ends_while_its_sandbox_waits_for_room_leaves_none(sandbox: ServedSandboxClient) -> None:
    sandbox.manager.config.max_alive = 1
    holder, late = context(sandbox, rollout_id="r-hold"), context(sandbox, rollout_id="r-late")
    await sandbox_session(holder)
    starting = asyncio.ensure_future(sandbox_session(late))
    await until(lambda: bool(late.resources), what="the late rollout asking for its sandbox")
    starting.cancel()  # its harness is stopped (a rollout timeout) while the create waits for room
    await late.close()
    assert late.resources[sandbox_sdk.SESSION_RESOURCE].exception().kind == "capacity"
    await holder.close()
    assert not sandbox.manager.sessions
