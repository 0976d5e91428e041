"""A verifiers taskset on the environment hub, unmodified, as a user puts it there: ``flywheel env
push DIR --as owner/name`` wraps the package (its own modules as its build backend built them,
a module running them through the bridge, the owner/name entry point), ``flywheel env install
owner/name`` puts it and what it needs that the services do not hold (verifiers and its pins)
in a folder of its own, ``flywheel eval owner/name --push`` scores it with verifiers' own
rewards and puts the row on its leaderboard, which ``flywheel env show`` prints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import stack_up
from tests.e2e.test_verifiers_envs import ECHO_EXPECTED, TASKSETS, echo_reply
from tests.scripted_openai import ScriptedOpenAI

pytestmark = pytest.mark.long  # flywheel up, a build, and an install of verifiers (about 1 to 2 min)


def test_a_verifiers_taskset_is_pushed_installed_evaluated_and_ranked(tmp_path: Path, readable: Path,
                                                                      clean_env: dict[str, str]) -> None:
    data = readable / "data"  # environment workers (users of their own) read what is installed there
    env = clean_env | {"FLYWHEEL_DATA_DIR": str(data)}

    def flywheel(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=timeout, check=False)

    def ok(done: subprocess.CompletedProcess[str]) -> str:
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout

    with stack_up(data, env) as ports:
        gateway = ["--gateway-url", f"http://127.0.0.1:{ports['gateway']}"]
        source = TASKSETS / "vf_echo"
        plain = flywheel("env", "push", str(source), *gateway)
        assert plain.returncode == 1 and "is a verifiers package: give the hub id it goes under (flywheel env push " \
            "DIR --as owner/name)" in plain.stderr, plain.stderr[-2000:]
        pushed = ok(flywheel("env", "push", str(source), "--as", "acme/echo", *gateway))
        assert re.search(r"^pushed acme/echo@0\.1\.0 \(sha256 [0-9a-f]{64}\)$", pushed, re.M), pushed
        assert "its rewards run inside its episodes" in pushed and "4 task rows" not in pushed, pushed

        installed = ok(flywheel("env", "install", "acme/echo", *gateway))
        folder = data / "environments" / "acme-echo-0.1.0"
        assert f"acme/echo is installed in {folder}" in installed, installed
        # Its modules as they are, the bridge's module, and verifiers with its pins; not the services' packages.
        assert (folder / "vf_echo" / "__init__.py").read_bytes() == (source / "vf_echo" / "__init__.py").read_bytes()
        assert (folder / "acme_echo_verifiers.py").is_file() and (folder / "verifiers").is_dir()
        assert not (folder / "pydantic").exists() and not (folder / "numpy").exists()

        with ScriptedOpenAI({"agent": [echo_reply] * 4}) as server:
            out = tmp_path / "echo.jsonl"
            evaluated = ok(flywheel("eval", "acme/echo", "--base-url", server.base_url, "--model", "agent", "-n", "4",
                                    "-r", "1", "-c", "1", "--out", str(out), "--push", "--env-args",
                                    '{"taskset": {"num_tasks": 4}}', *gateway))
        assert "pushed to the hub: acme/echo@0.1.0's leaderboard" in evaluated, evaluated
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert {r["task"]["word"]: r["rewards"]["verifiers"] for r in records} == ECHO_EXPECTED
        shown = ok(flywheel("env", "show", "acme/echo", *gateway))
        assert "leaderboard:" in shown and re.search(r"^agent +0\.1\.0 ", shown, re.M), shown
