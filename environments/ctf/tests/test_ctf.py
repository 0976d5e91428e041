"""ctf against a real sandbox service (local backend) over a real nats-server: an agent that runs
the right bash commands finds every task's flag and gets reward 1; wrong flags get 0 and use up
the submissions; the flag is in no task row or prompt; the sandbox is gone after each rollout."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import ctf
from flywheel.contract import events
from flywheel.sdk.environment import EnvironmentLoadError
from flywheel.sdk.harness import RolloutContext
from flywheel.sdk.sandbox import SandboxSpec
from flywheel.sdk.sandbox_tools import SandboxUnavailable
from tests.sandbox_fixtures import sandboxed_rollout
from tests.sandbox_service import ServedSandboxClient
from tests.scripted_openai import ScriptEntry, tool_call

FLAG = re.compile(r"flag\{[0-9a-f]{20}\}")
SOLVE = {
    "hidden-backup": "grep -rho 'flag{[0-9a-f]*}' projects",
    "base64-message": "base64 -d message.txt",
    "rot13-letter": "tr 'A-Za-z' 'N-ZA-Mn-za-m' < letter.txt",
    "hex-dump": "xxd -r -p memory.dump",
    "tar-backup": "tar -xzOf backups/nightly.tar.gz home/user/.config/vault/secret.txt",
    "locked-file": "cat vault/flag.txt || chmod u+r vault/flag.txt && cat vault/flag.txt",
    "locked-tree": "chmod -R u+rwx safe && cat safe/inner/core/flag.txt",
    "log-needle": "grep -rho 'flag{[0-9a-f]*}' logs",
    "fragments": "for i in 1 2 3; do cat $(find . -name fragment-$i.txt); done | tr -d '\\n'",
    "oldest-message": "cat \"$(ls -tr inbox/* | head -1)\"",
    "sqlite-db": "python3 -c \"import sqlite3; print(sqlite3.connect('data/app.db').execute("
                 "\\\"select api_key from users where role = 'admin'\\\").fetchone()[0])\"",
    "reversed-base64": "rev note.txt | base64 -d",
    "compressed-payload": "base64 -d mail/attachment.b64 | gunzip | grep -o 'flag{[0-9a-f]*}'",
    "pin-script": "python3 -c \"import unlock; print([f for f in map(unlock.unlock, (f'{i:04d}' for i in "
                  "range(10000))) if f][0])\"",
    "disguised-file": "file pictures/beach.jpg; tar -xzOf pictures/beach.jpg | grep -o 'flag{[0-9a-f]*}'",
}

# A search for anything shaped like a flag finds the real one only where it is stored as is.
GREP = "grep -rhoa 'flag{[0-9a-f]*}' . 2>/dev/null"
PLAIN = {"hidden-backup", "log-needle", "oldest-message", "sqlite-db"}


@pytest.fixture(scope="module")
def env():
    return ctf.load_environment(max_turns=6)


def submit_what_was_found(body: dict[str, Any]) -> dict[str, Any]:
    """The agent's next move: submit the one flag the last command printed."""
    said = [m["content"] for m in body["messages"] if m["role"] == "tool"][-1]
    found = set(FLAG.findall(said))
    assert len(found) == 1, said
    return tool_call("submit_flag", flag=found.pop())


async def rewards(env, rollout: events.Rollout) -> dict[str, float]:
    return {name: (await r(rollout)).value for name, r in env.rollout_rewards.items()}


def test_the_tasks_name_known_challenges(env, tmp_path) -> None:
    rows = env.load_tasks(env.tasks.size)
    assert len(rows) == 15 and {r["challenge"] for r in rows} == set(ctf.CHALLENGES)
    assert set(SOLVE) == {r["id"] for r in rows}
    assert not any("flag{" in json.dumps(r) for r in rows)
    bad = tmp_path / "tasks.jsonl"
    bad.write_text(json.dumps({"id": "x", "challenge": "kernel_exploit", "prompt": "p"}) + "\n")
    with pytest.raises(EnvironmentLoadError, match="names challenge 'kernel_exploit'"):
        ctf.load_environment(tasks_file=str(bad))


async def test_an_agent_with_the_right_commands_captures_every_flag(env, sandbox: ServedSandboxClient) -> None:
    for task in env.load_tasks(env.tasks.size):
        script: list[ScriptEntry] = [tool_call("bash", command=GREP), tool_call("bash", command=SOLVE[task["id"]]),
                                     submit_what_was_found]
        rollout, server = await sandboxed_rollout(env, task, script, sandbox)
        first = json.dumps(server.requests_for("agent")[0]["messages"])
        submitted = rollout.state["submissions"][0]
        assert submitted not in first and submitted not in json.dumps(task) and submitted not in json.dumps(
            {k: v for k, v in rollout.state.items() if k != "submissions"})
        assert rollout.state["captured"] and rollout.state["stop_reason"] == "stop", (task["id"], rollout.state)
        assert await rewards(env, rollout) == {"captured": 1.0, "num_submissions": 1.0, "num_commands": 2.0}
        assert not sandbox.manager.sessions, task["id"]  # destroyed with the rollout
        grepped = next(m["content"] for m in server.conversation("agent") if m["role"] == "tool")
        assert (submitted in grepped) == (task["id"] in PLAIN), (task["id"], grepped)  # the puzzles need solving


async def test_wrong_flags_score_zero_and_use_up_the_submissions(env, sandbox: ServedSandboxClient) -> None:
    task = next(r for r in env.load_tasks(env.tasks.size) if r["id"] == "oldest-message")
    # Every decoy looks like a flag; taking the newest message instead of the oldest is wrong.
    newest = tool_call("bash", command="cat \"$(ls -t inbox/* | head -1)\"")
    script: list[ScriptEntry] = [newest, submit_what_was_found, tool_call("submit_flag", flag="flag{0000}"),
              tool_call("submit_flag", flag="  not even a flag ")]
    rollout, server = await sandboxed_rollout(env, task, script, sandbox)
    said = [m["content"] for m in server.conversation("agent") if m["role"] == "tool"]
    assert said[1:] == ["Wrong flag. 2 submissions left.", "Wrong flag. 1 submission left."]
    assert rollout.state["submissions"][1:] == ["flag{0000}", "not even a flag"] and not rollout.state["captured"]
    assert rollout.state["stop_reason"] == "stop"
    assert await rewards(env, rollout) == {"captured": 0.0, "num_submissions": 3.0, "num_commands": 1.0}
    assert not sandbox.manager.sessions


async def test_a_submission_past_the_limit_and_a_looping_command(sandbox: ServedSandboxClient) -> None:
    env = ctf.load_environment(max_submissions=1, command_timeout_s=1)
    task = {"id": "loop", "challenge": "locked_file", "prompt": "p"}
    script = [tool_call("bash", command="while true; do :; done"), tool_call("bash", command="ls -l vault"),
              tool_call("submit_flag", flag="flag{guess}")]
    rollout, server = await sandboxed_rollout(env, task, script, sandbox)
    said = [m["content"] for m in server.conversation("agent") if m["role"] == "tool"]
    assert said[0].startswith("timed out after 1 s") and "---------- 1 " in said[1]
    assert rollout.state["submissions"] == ["flag{guess}"] and rollout.state["stop_reason"] == "stop"
    assert (await rewards(env, rollout))["captured"] == 0.0 and not sandbox.manager.sessions
    game = ctf.Game(SandboxSpec(), max_submissions=2)
    ctx = RolloutContext(task=task, base_url="", api_key="", model="",
                         state={"flag_sha256": ctf.sha256("flag{right}"), "submissions": []})
    assert game.submit_flag("flag{wrong}", ctx) == "Wrong flag. 1 submission left."
    assert game.submit_flag(" flag{right}\n", ctx) == "Correct: flag captured."
    assert game.submit_flag("flag{right}", ctx) == "You already captured the flag."
    ctx.state["captured"] = False
    with pytest.raises(ctf.ToolError, match="no submissions left"):
        game.submit_flag("flag{again}", ctx)
    assert ctf.captured(ctx.state) == 1.0 and ctf.captured({}) == 0.0


async def test_no_sandbox_service_fails_the_rollout_with_what_to_do(env) -> None:
    task = env.load_tasks(1)[0]
    ctx = RolloutContext(task=task, base_url="http://127.0.0.1:9/v1", api_key="t", model="agent")
    with pytest.raises(SandboxUnavailable, match=r"start the sandbox service \(flywheel up\) or set nats_url"):
        await env.harness.run(env, ctx)
