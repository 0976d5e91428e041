"""The harnesses against a scripted OpenAI-compatible server (a real HTTP endpoint, a scripted
model): the chat harness's tool loop with function and MCP tools, stop conditions, turns and
truncation; the program harness's environment, state, timeout (its process group killed), own
files, and runtimes as an environment or a run config swaps them."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import typing
from pathlib import Path

import pytest
from mcp.server.mcpserver import MCPServer

from flywheel.contract.config import RunConfig, Runtime
from flywheel.sdk.environment import Environment, EnvironmentLoadError, Reward, overrides_of
from flywheel.sdk.harness import RUNTIMES, ChatHarness, ProgramHarness, RolloutContext, Tool
from flywheel.sdk.sandbox import SandboxUnavailable
from tests.scripted_openai import ScriptedOpenAI, tool_call


def env_with(harness: ChatHarness | ProgramHarness) -> Environment:
    return Environment(name="t", tasks=[{"prompt": "hi", "n": 3}], harness=harness,
                       rewards=[Reward(lambda completion: 0.0, name="zero")])


def ctx_for(server: ScriptedOpenAI, task: dict | None = None) -> RolloutContext:
    return RolloutContext(task=task or {"prompt": "hi", "n": 3}, base_url=server.base_url, api_key="k", model="agent")


async def test_function_and_mcp_tools_are_called_and_errors_go_back_to_the_model() -> None:
    def add(a: int, b: int, ctx: RolloutContext) -> int:
        """Add two integers."""
        ctx.state.setdefault("adds", 0)
        ctx.state["adds"] += 1
        return a + b

    mcp = MCPServer("m")

    @mcp.tool()
    def shout(text: str) -> str:
        """Upper-case the text."""
        return text.upper()

    harness = ChatHarness(system_prompt="Use tools.", tools=[add, mcp], max_turns=5)
    with ScriptedOpenAI({"agent": [tool_call("add", a=2, b=3), tool_call("add", a="x", b=1),
                                   tool_call("shout", text="ok"), tool_call("nope"), "done"]}) as server:
        ctx = ctx_for(server)
        await harness.run(env_with(harness), ctx)
        first = server.requests_for("agent")[0]
        assert {t["function"]["name"] for t in first["tools"]} == {"add", "shout"}
        add_spec = next(t for t in first["tools"] if t["function"]["name"] == "add")["function"]
        assert add_spec["description"] == "Add two integers."
        assert set(add_spec["parameters"]["properties"]) == {"a", "b"}
        tool_answers = [m["content"] for m in server.conversation("agent") if m["role"] == "tool"]
    assert tool_answers[0] == "5" and tool_answers[2] == "OK"
    assert tool_answers[1].startswith("error: invalid arguments for add") and "no tool named 'nope'" in tool_answers[3]
    assert ctx.state["adds"] == 1 and ctx.state["turns"] == 5 and ctx.state["stop_reason"] == "done"


async def test_stop_max_turns_env_response_and_truncation_end_the_loop() -> None:
    def feedback(messages: list[dict], state: dict) -> str | None:
        state["replies"] = state.get("replies", 0) + 1
        return None if messages[-1]["content"] == "win" else "try again"

    harness = ChatHarness(env_response=feedback, max_turns=3)
    with ScriptedOpenAI({"agent": ["a", "win"]}) as server:
        ctx = ctx_for(server)
        await harness.run(env_with(harness), ctx)
    assert ctx.state["turns"] == 2 and ctx.state["replies"] == 2 and ctx.state["stop_reason"] == "done"

    with ScriptedOpenAI({"agent": ["a", "b", "c"]}) as server:
        ctx = ctx_for(server)
        await harness.run(env_with(harness), ctx)
    assert ctx.state["turns"] == 3 and ctx.state["stop_reason"] == "max_turns"

    stopping = ChatHarness(env_response=lambda: "more", stop=lambda messages, task: len(messages) >= 4, max_turns=9)
    with ScriptedOpenAI({"agent": ["a", "b"]}) as server:
        ctx = ctx_for(server)
        await stopping.run(env_with(stopping), ctx)
    assert ctx.state["stop_reason"] == "stop" and ctx.state["turns"] == 2

    with ScriptedOpenAI({"agent": [{"content": "cut", "finish_reason": "length"}]}) as server:
        ctx = ctx_for(server)
        await harness.run(env_with(harness), ctx)
    assert ctx.state["truncated"] is True and ctx.state["stop_reason"] == "truncated"


def test_a_tool_schema_comes_from_type_hints_without_ctx() -> None:
    def search(query: str, limit: int = 5, ctx: RolloutContext | None = None) -> list[str]:
        """Search the documents."""
        return []

    spec = Tool(search).spec()["function"]
    assert spec["name"] == "search" and spec["parameters"]["required"] == ["query"]
    assert spec["parameters"]["properties"]["limit"] == {"type": "integer", "default": 5}
    with pytest.raises(ValueError, match="max_turns=0"):
        ChatHarness(max_turns=0)


async def test_a_program_gets_its_url_key_and_task_and_reports_state(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        from openai import OpenAI
        task = json.load(sys.stdin)
        reply = OpenAI().chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                                 messages=[{"role": "user", "content": task["prompt"]}])
        print("some log line")
        n = json.loads(os.environ["FLYWHEEL_TASK"])["n"]
        print(json.dumps({"answer": reply.choices[0].message.content, "n": n}))
    """))
    harness = ProgramHarness([sys.executable, str(script)], timeout_s=60)
    with ScriptedOpenAI({"agent": ["42"]}) as server:
        ctx = ctx_for(server)
        await harness.run(env_with(harness), ctx)
        assert server.requests_for("agent")[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert ctx.state["answer"] == "42" and ctx.state["n"] == 3 and "some log line" in ctx.state["stdout"]


async def test_a_program_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
                                  "import time; time.sleep(60)"])  # noqa: sleep - the slow program under test
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)  # noqa: sleep - the program outlives its timeout on purpose
    """))
    harness = ProgramHarness([sys.executable, str(script)], timeout_s=1.5)
    with ScriptedOpenAI({"agent": []}) as server:
        with pytest.raises(TimeoutError, match=r"timeout_s=1\.5"):
            await harness.run(env_with(harness), ctx_for(server))
    child = int(pid_file.read_text())
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:  # reap it if it is ours (it is not: it was the program's child, now re-parented)
            os.waitpid(child, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG: it returns at once
        except ChildProcessError:
            pass
        await asyncio.sleep(0.05)  # noqa: sleep - polling for the killed process to be gone
    else:
        raise AssertionError(f"the program's child {child} outlived the timeout")


async def test_a_failing_program_is_an_error_naming_its_exit(tmp_path: Path) -> None:
    harness = ProgramHarness([sys.executable, "-c", "import sys; print('bad', file=sys.stderr); sys.exit(3)"])
    with ScriptedOpenAI({"agent": []}) as server:
        with pytest.raises(RuntimeError, match="exited with 3: bad"):
            await harness.run(env_with(harness), ctx_for(server))


async def test_a_program_s_own_files_are_written_where_it_runs() -> None:
    """``files`` travel with the program: the subprocess runtime runs it in a fresh folder that
    holds them, so one relative argv serves every runtime."""
    harness = ProgramHarness(["{python}", "agent.py"], files={
        "agent.py": "import json, os, pathlib\nprint(json.dumps({'data': pathlib.Path('data/x.txt').read_text(), "
                    "'cwd': os.getcwd()}))\n",
        "data/x.txt": b"bytes too"})
    with ScriptedOpenAI({"agent": []}) as server:
        ctx = ctx_for(server)
        await harness.run(env_with(harness), ctx)
    assert ctx.state["data"] == "bytes too" and not Path(ctx.state["cwd"]).exists()  # the folder went with it


async def test_runtimes_are_swapped_by_name_and_only_for_a_program() -> None:
    program = env_with(ProgramHarness(["{python}", "agent.py"]))
    boxed = program.with_runtime("sandbox")
    assert isinstance(boxed.harness, ProgramHarness) and boxed.harness.runtime == "sandbox"
    assert isinstance(program.harness, ProgramHarness) and program.harness.runtime == "subprocess"  # a copy
    assert program.with_runtime(None) is program
    assert boxed.rewards == program.rewards and boxed.name == program.name
    with pytest.raises(EnvironmentLoadError, match="'docker': a program harness runs in one of subprocess, sandbox"):
        program.with_runtime("docker")
    with pytest.raises(EnvironmentLoadError, match="has a ChatHarness, which runs in the process that runs its"):
        env_with(ChatHarness()).with_runtime("sandbox")
    with pytest.raises(ValueError, match="runtime='vm'"):
        ProgramHarness(["x"], runtime="vm")
    # A run config says it per environment (or at the top for its one environment).
    assert typing.get_args(Runtime) == RUNTIMES
    cfg = RunConfig.parse({"run": "r", "env": "reverse_text", "runtime": "sandbox"})
    assert overrides_of(cfg.environments[0]).runtime == "sandbox"
    with pytest.raises(ValueError, match="runtime: a run with \\[\\[envs\\]\\] names its environments there"):
        RunConfig.parse({"run": "r", "runtime": "sandbox", "envs": [{"id": "reverse_text"}]})
    with pytest.raises(ValueError, match="runtime"):
        RunConfig.parse({"run": "r", "env": "reverse_text", "runtime": "vm"})


async def test_the_sandbox_runtime_without_a_sandbox_service_says_what_to_start() -> None:
    harness = ProgramHarness(["{python}", "agent.py"], runtime="sandbox", files={"agent.py": "print(1)"})
    with ScriptedOpenAI({"agent": []}) as server:
        with pytest.raises(SandboxUnavailable, match=r"start the sandbox service \(flywheel up\) or set nats_url"):
            await harness.run(env_with(harness), ctx_for(server))


def test_a_command_line_swaps_the_harness_in_eval_or_a_run_config() -> None:
    env = env_with(ChatHarness())
    swapped = env.with_harness("{python} 'my agent.py' --fast").with_runtime("sandbox")
    assert isinstance(swapped.harness, ProgramHarness)
    assert list(swapped.harness.argv) == ["{python}", "my agent.py", "--fast"] and swapped.harness.runtime == "sandbox"
    assert env.with_harness(None) is env and isinstance(env.harness, ChatHarness)
    for bad, says in (("", "give a command line"), ("agent 'unclosed", "not a command line")):
        with pytest.raises(EnvironmentLoadError, match=says):
            env.with_harness(bad)
    cfg = RunConfig.parse({"run": "r", "envs": [{"id": "reverse_text", "harness": "codex exec", "runtime": "sandbox"}]})
    overrides = overrides_of(cfg.environments[0])
    assert (overrides.harness, overrides.runtime) == ("codex exec", "sandbox")
    assert RunConfig.parse({"run": "r", "env": "reverse_text", "harness": "x"}).environments[0].harness == "x"
