"""verifiers tasksets run unmodified through the bridge (``env = "verifiers:<taskset>"``), as a user
runs them: ``flywheel env install verifiers:<folder>`` puts each taskset and verifiers into a
folder of its own (verifiers pins ``mcp==2.0.0``, which the services' environment does not
have), then ``flywheel eval`` and ``flywheel run`` name them. The tasksets are written the way
verifiers' own scaffold (``vf-init``) writes them: ``tests/envs/verifiers/vf_echo`` (one turn,
two weighted rewards and a metric) and ``vf_lookup`` (a tool on an MCP server, several turns).

Rewards are checked twice: against values worked out by hand from the scripted replies, and
against verifiers' own scoring of the same completions (``tests/envs/verifiers/rescore.py``
scores each recorded verifiers trace again with the task's own functions, in the taskset's
environment)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flywheel.runtime.natsserver import free_port
from tests.scripted_openai import ScriptedOpenAI, tool_call

ROOT = Path(__file__).resolve().parents[2]
TASKSETS = ROOT / "tests" / "envs" / "verifiers"
RESCORE = TASKSETS / "rescore.py"


def cli(*argv: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, check=False)


@contextlib.contextmanager
def installed(*specs: str) -> Iterator[Path]:
    """A data dir other users may read (environment workers run as users of their own; pytest's
    folders are closed to them) with ``specs`` installed (``flywheel env install``)."""
    data = Path(tempfile.mkdtemp(prefix="flywheel-readable-"))
    data.chmod(0o755)
    try:
        for spec in specs:
            done = cli("env", "install", spec, "--data-dir", str(data))
            assert done.returncode == 0, done.stdout + done.stderr
            assert "installed in" in done.stdout
        yield data
    finally:
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """A data dir with both tasksets installed, each in its own folder."""
    with installed(*(f"verifiers:{TASKSETS / name}" for name in ("vf_echo", "vf_lookup"))) as data:
        yield data


def folder(data_dir: Path, taskset: str) -> Path:
    return data_dir / "environments" / f"verifiers-{taskset}"


def evaluate(data_dir: Path, env: str, server: ScriptedOpenAI, out: Path, num: int) -> list[dict[str, Any]]:
    """The taskset's first ``num`` tasks (its config's num_tasks), each once."""
    done = cli("eval", env, "--base-url", server.base_url, "--model", "agent", "-n", str(num), "-r", "1", "-c", "1",
               "--data-dir", str(data_dir), "--out", str(out), "--env-args",
               json.dumps({"taskset": {"num_tasks": num}}))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def rescored(data_dir: Path, taskset: str, results: Path) -> list[dict[str, Any]]:
    """verifiers' own scoring of the recorded rollouts, in the taskset's own environment."""
    done = subprocess.run([sys.executable, str(RESCORE), taskset, str(results)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(folder(data_dir, taskset))}, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_verifiers_scored_alike(records: list[dict[str, Any]], own: list[dict[str, Any]]) -> None:
    assert len(own) == len(records)
    for record, theirs in zip(records, own, strict=True):
        assert record["error"] is None, record["error"]
        # The completion verifiers scored is the one Flywheel recorded.
        assert theirs["last_reply"] == record["messages"][-1]["content"]
        # Flywheel's reward is verifiers' trace.reward, component by component.
        assert record["rewards"]["verifiers"] == pytest.approx(theirs["reward"], abs=1e-12)
        assert record["components"]["verifiers"] == {k: r["score"] for k, r in theirs["rewards"].items()}
        for name, value in theirs["metrics"].items():
            assert record["rewards"][name] == value


ECHO_REPLIES = {"apple": "apple", "river": "I would rather not say that word", "stone": "stone stone stone stone",
                "cloud": "Cloud."}
# says_word (weight 1) + brief (weight 0.5: three words at most), worked out by hand
ECHO_EXPECTED = {"apple": 1.5, "river": 0.0, "stone": 1.0, "cloud": 1.5}


def echo_reply(body: dict[str, Any]) -> str:
    """The scripted model's reply to a vf-echo task: ECHO_REPLIES of the word it asks for."""
    word = re.search(r"Say the word (\w+)", body["messages"][-1]["content"])
    assert word is not None, body["messages"]
    return ECHO_REPLIES[word.group(1)]


@pytest.mark.long  # installs verifiers into a folder (about 20 s), then runs the CLI
def test_a_single_turn_verifiers_taskset_evaluates_with_verifiers_own_rewards(data_dir: Path, tmp_path: Path) -> None:
    with ScriptedOpenAI({"agent": [echo_reply] * 4}) as server:
        out = tmp_path / "echo.jsonl"
        records = evaluate(data_dir, "verifiers:vf-echo", server, out, num=4)
    assert sorted(r["task"]["word"] for r in records) == sorted(ECHO_EXPECTED)
    for record in records:
        assert record["rewards"]["verifiers"] == ECHO_EXPECTED[record["task"]["word"]]
        assert record["rewards"]["reply_chars"] == len(ECHO_REPLIES[record["task"]["word"]])
    assert_verifiers_scored_alike(records, rescored(data_dir, "vf-echo", out))


@pytest.mark.long  # installs verifiers into a folder (about 20 s), then runs the CLI
def test_a_multi_turn_verifiers_taskset_calls_its_mcp_tool(data_dir: Path, tmp_path: Path) -> None:
    def look_up(body: dict[str, Any]) -> dict[str, Any]:
        (tool,) = body["tools"]  # the taskset's MCP tool, offered to the model as verifiers names it
        room = re.search(r"room (\w+)", body["messages"][-1]["content"])
        assert room is not None
        return tool_call(tool["function"]["name"], room=room.group(1))

    def answer(body: dict[str, Any]) -> str:
        assert body["messages"][-1]["role"] == "tool"
        return f"The code is {body['messages'][-1]['content']}."

    with ScriptedOpenAI({"agent": [look_up, answer, "The code is 0000.", look_up, answer]}) as server:
        out = tmp_path / "lookup.jsonl"
        records = evaluate(data_dir, "verifiers:vf-lookup", server, out, num=3)
    # In task order (one at a time): the first looked up and answered, the second guessed, the third looked up.
    by_turns = sorted(records, key=lambda r: r["rewards"]["tool_calls"])
    assert [r["rewards"]["tool_calls"] for r in by_turns] == [0.0, 1.0, 1.0]
    assert [r["rewards"]["verifiers"] for r in by_turns] == [0.0, 1.0, 1.0]
    looked_up = by_turns[-1]
    assert [m["role"] for m in looked_up["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert looked_up["messages"][2]["content"] == looked_up["task"]["code"]
    assert_verifiers_scored_alike(records, rescored(data_dir, "vf-lookup", out))


@pytest.mark.long
@pytest.mark.timeout(900)
def test_two_verifiers_tasksets_train_side_by_side_in_one_run(data_dir: Path, tmp_path: Path) -> None:
    """Both pin mcp==2.0.0 (verifiers' pin; the services have another mcp): each runs in workers
    with its own folder first on the path, in one run of the tiny model."""
    config = tmp_path / "run.toml"
    config.write_text("""run = "vf"
group_size = 2
seed = 0

[[envs]]
id = "verifiers:vf-echo"
weight = 1

[[envs]]
id = "verifiers:vf-lookup"
weight = 1

[model]
name = "tiny-long"

[sampling]
max_tokens = 8

[trainer]
batch_size = 4
num_steps = 3
lr = 1e-3
""")
    done = cli("run", str(config), "--run-id", "vf", "--data-dir", str(data_dir), "--nats-port", str(free_port()),
               "--gateway-port", str(free_port()), "--inference-port", str(free_port()), timeout_s=840)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    run_dir = data_dir / "runs" / "vf"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["num_loss_tokens"] > 0 for s in steps), steps  # exact tokens from the interception trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3


def test_a_verifiers_taskset_not_installed_says_how_to_install_it(tmp_path: Path) -> None:
    done = cli("eval", "verifiers:vf-nowhere", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "-n", "1",
               "--data-dir", str(tmp_path))
    assert done.returncode != 0
    assert "flywheel env install verifiers:" in done.stderr and "vf-nowhere" in done.stderr


def test_a_package_that_is_no_verifiers_taskset_is_refused(tmp_path: Path) -> None:
    project = tmp_path / "plain"
    (project / "plain_pkg").mkdir(parents=True)
    (project / "plain_pkg" / "__init__.py").write_text("")
    (project / "pyproject.toml").write_text('[project]\nname = "plain-pkg"\nversion = "0.1.0"\n\n[build-system]\n'
                                            'requires = ["hatchling"]\nbuild-backend = "hatchling.build"\n')
    done = cli("env", "install", f"verifiers:{project}", "--data-dir", str(tmp_path / "data"))
    assert done.returncode != 0
    assert "does not depend on verifiers" in done.stderr
    assert not (tmp_path / "data" / "environments" / "verifiers-plain-pkg").exists()  # nothing half installed


@pytest.mark.long  # installs verifiers into a folder (about 20 s), then runs the CLI
def test_a_taskset_s_folder_holds_verifiers_and_its_pins_and_nothing_the_services_have(data_dir: Path) -> None:
    held = {d.metadata["Name"].lower(): d.version
            for d in importlib.metadata.distributions(path=[str(folder(data_dir, "vf-echo"))])}
    assert held["vf-echo"] == "0.1.0" and held["verifiers"] == "0.4.0"
    assert held["mcp"] == "2.0.0" != importlib.metadata.version("mcp")  # the pin the services do not satisfy
    assert "pydantic" not in held and "numpy" not in held  # the services' copies serve


@pytest.mark.long  # installs verifiers into a folder of its own (about 20 s)
def test_a_verifiers_reward_cannot_leave_its_sandbox(tmp_path: Path) -> None:
    """A taskset's reward tries to read a file of the data dir, reach the model server's own port
    on the host (only its endpoint, through the relay, is the way out), reach the internet and
    write into its package's folder: each attempt fails, and the rollout is still scored."""
    with installed(f"verifiers:{TASKSETS / 'vf_escape'}") as data, ScriptedOpenAI({"agent": ["hi"]}) as server:
        secret = data / "secret.txt"
        secret.write_text("the data dir's")
        secret.chmod(0o644)  # readable by anyone who can see it: only the sandbox stands in the way
        port = int(server.base_url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            pass  # outside a sandbox the port answers, and the file reads: the attempts aim at real things
        assert secret.read_text()
        out = tmp_path / "escape.jsonl"
        done = cli("eval", "verifiers:vf-escape", "--base-url", server.base_url, "--model", "agent", "-n", "1",
                   "--data-dir", str(data), "--out", str(out), "--env-args",
                   json.dumps({"taskset": {"secret_file": str(secret), "host_port": port}}))
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        (record,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert record["error"] is None, record["error"]
        assert {k: record["rewards"][k] for k in ("read_host_file", "reached_host_port", "reached_internet",
                                                  "wrote_own_package")} == dict.fromkeys(
            ("read_host_file", "reached_host_port", "reached_internet", "wrote_own_package"), 0.0)
        assert record["rewards"]["verifiers"] == 0.0
        assert not list(folder(data, "vf-escape").rglob("planted.txt"))
