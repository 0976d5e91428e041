"""An OpenEnv environment runs unmodified through the bridge (``env = "openenv:<package>"``), in
process and over its WebSocket session, as a user runs it: ``flywheel env install
openenv:<folder>`` puts the package and openenv-core into a folder of its own, then ``flywheel
eval`` and ``flywheel run`` name it. The environment, ``tests/envs/openenv/guess_number``, is laid
out as ``openenv init`` lays one out (models, server, app): a secret number from 1 to 20, five
guesses answered higher or lower, reward 1 for finding it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flywheel.runtime.natsserver import free_port
from tests.e2e.test_verifiers_envs import cli, installed
from tests.scripted_openai import ScriptedOpenAI

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tests" / "envs" / "openenv" / "guess_number"

pytestmark = pytest.mark.long  # installs openenv-core (with gradio) into a folder and starts stacks: minutes


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    with installed(f"openenv:{PACKAGE}") as data:
        yield data


def bisect(body: dict[str, Any]) -> str:
    """A player that halves the range from the hints so far (and thinks aloud around its JSON)."""
    low, high, last = 1, 20, None
    for message in body["messages"]:
        if message["role"] == "assistant":
            found = re.search(r"\{.*\}", message["content"])
            last = json.loads(found.group(0))["guess"] if found else None
        elif message["role"] == "user" and last is not None and message["content"].startswith("{"):
            hint = json.loads(message["content"])["feedback"]
            low, high = (last + 1, high) if hint == "higher" else (low, last - 1) if hint == "lower" else (low, high)
    return f'Between {low} and {high}, so: {{"guess": {(low + high) // 2}}}'


@pytest.mark.parametrize("transport", ["inprocess", "websocket"])
def test_an_openenv_environment_plays_episodes_with_its_own_rewards(data_dir: Path, tmp_path: Path,
                                                                     transport: str) -> None:
    replies: list[Any] = ["I will guess seven.", '{"guess": 25}', *[bisect] * 30]
    with ScriptedOpenAI({"agent": replies}) as server:
        out = tmp_path / "results.jsonl"
        done = cli("eval", "openenv:guess-number", "--base-url", server.base_url, "--model", "agent", "-n", "3",
                   "-r", "1", "-c", "1", "--data-dir", str(data_dir), "--out", str(out),
                   "--env-args", json.dumps({"transport": transport, "max_turns": 8}))
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        first = server.requests_for("agent")[0]["messages"]
        hints = [m["content"] for m in server.requests_for("agent")[2]["messages"] if m["role"] == "user"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # The system prompt carries the action's schema; the reset's observation is the first user message.
    assert first[0]["role"] == "system" and '"guess"' in first[0]["content"] and "metadata" not in first[0]["content"]
    assert json.loads(first[1]["content"]) == {"feedback": "I picked a number from 1 to 20. Guess it.",
                                               "guesses_left": 5}
    # Unparseable replies cost a turn each, with a message naming what was wrong.
    assert "no JSON object in the reply" in hints[1]
    assert "guess: Input should be less than or equal to 20" in hints[2]
    for record in records:
        assert record["error"] is None, record["error"]
        assert record["rewards"]["reward"] == 1.0 and record["rewards"]["done"] == 1.0  # bisection finds it in 5
        assert record["state"]["openenv"]["rewards"][-1] == 1.0
    assert sorted(r["rewards"]["invalid_actions"] for r in records) == [0.0, 0.0, 2.0]


@pytest.mark.parametrize("transport", ["inprocess", "websocket"])
@pytest.mark.timeout(600)
def test_an_openenv_environment_trains(data_dir: Path, tmp_path: Path, transport: str) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f"""run = "oe-{transport}"
env = "openenv:guess-number"
group_size = 2
seed = 0

[env_args]
transport = "{transport}"
max_turns = 3

[model]
name = "tiny-long"

[sampling]
max_tokens = 12

[trainer]
batch_size = 4
num_steps = 2
lr = 1e-3
""")
    run = f"oe-{transport}"
    done = cli("run", str(config), "--run-id", run, "--data-dir", str(data_dir), "--nats-port", str(free_port()),
               "--gateway-port", str(free_port()), "--inference-port", str(free_port()), timeout_s=540)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    steps = [json.loads(line) for line in (data_dir / "runs" / run / "metrics.jsonl").read_text().splitlines()][1:]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["num_loss_tokens"] > 0 for s in steps), steps
