"""An environment runs the same in ``flywheel eval`` and in training: the same statuses, errors,
states, scores and rewards, rollout for rollout.

The environment (tests/envs/parity_env.py) is multi-turn, with a tool and state, and has a
row for every way a rollout ends or scores (the harness raising, running past the rollout
timeout, never calling the model, leaving a state that is not JSON; a reward returning a
non-number, one past the reward timeout; a group reward), none of which depends on what the
model says. Training: the inference worker on the tiny model (real nats-server), the
built-in scorer, the recorder writing the gateway's store, read back through the trace
API's export. Eval: ``flywheel eval``'s :class:`Evaluation` against a scripted OpenAI
endpoint (tests/scripted_openai.py), its errors shown as the trace API shows a rollout's (its
own message, then each failed scorer's). Both with the same rollout and reward timeouts.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from flywheel.contract import events
from flywheel.contract.bus import Bus, Consumer
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import register_run
from flywheel.contract.settings import InferenceSettings, RecorderSettings, ScorerSettings
from flywheel.runtime import runs
from flywheel.runtime.evalresults import read_results
from flywheel.runtime.evaluation import EvalConfig, Evaluation
from flywheel.sdk import models
from flywheel.sdk.environment import TaskSet, load_environment
from flywheel.sdk.scoring import required_scorers
from flywheel_gateway import recorder
from flywheel_gateway.recorder import mirror_runs
from flywheel_gateway.store import Store, shown_error
from flywheel_scorer import scorer
from flywheel_scorer.partitions import Partitions
from flywheel_scorer.scorer import EnvironmentRewards
from tests.helpers import until, worker_pool
from tests.integration.services import Workers
from tests.integration.test_inference_worker import publish_weights
from tests.scripted_openai import ScriptedOpenAI

ENVS = Path(__file__).parents[1] / "envs"
ROLLOUT_TIMEOUT_S = 3.0
REWARD_TIMEOUT_S = 1.0
NUM_ROLLOUTS = 2


@pytest.fixture
def parity_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))  # the environment is importable by id, as an installed one


def outcome(status: str, error: str | None, state: dict[str, Any], scores: list[dict[str, Any]],
            reward: float | None) -> dict[str, Any]:
    """What must agree, from a rollout and its scores, whoever ran them."""
    return {"status": status, "error": error, "state": state, "reward": reward,
            "rewards": {s["scorer"]: s["value"] for s in scores if s["error"] is None},
            "reward_errors": {s["scorer"]: s["error"] for s in scores if s["error"] is not None}}


async def exported(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """Run r1's rollouts as the trace API exports them, checked complete: its last line is the end line."""
    *lines, end = [json.loads(line) for line in
                   (await client.get("/v1/rollouts/export", params={"run": "r1"})).text.splitlines()]
    assert end == {"end": {"num_rollouts": len(lines)}}, end
    return lines


async def in_training(app: FastAPI, client: httpx.AsyncClient, store: Store, bus: Bus,
                      start_worker: Workers, model_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    from parity_env import MODES  # type: ignore[import-not-found]  # tests/envs: on sys.path by the parity_env fixture

    # Admission lets every group out before a first step (no trainer runs here).
    cfg = RunConfig(run="r1", env="parity_env", group_size=NUM_ROLLOUTS, model={"name": str(model_dir)},
                    sampling={"max_tokens": 4},
                    trainer={"batch_size": len(MODES) * NUM_ROLLOUTS, "max_off_policy_steps": 0})
    env = load_environment("parity_env")
    await register_run(bus, "r1", config=cfg.model_dump(), scorers=required_scorers(cfg, env))
    base, _ = models.load_model(model_dir)
    await publish_weights(bus, "r1", 0, base)
    await start_worker(InferenceSettings(rollout_timeout_s=ROLLOUT_TIMEOUT_S, backoff_s=(0.2,), max_deliver=50))
    assert isinstance(env.tasks, TaskSet) and env.tasks.size is not None  # a list of rows
    rows = env.load_tasks(env.tasks.size)  # each row once
    stopping = asyncio.Event()
    async with worker_pool("scorer") as workers:
        rewards = EnvironmentRewards()
        await rewards.start(bus, workers)
        consumers: list[Consumer | Partitions]
        consumers = [*recorder.build(bus, store, RecorderSettings(), streams=("ROLLOUTS", "SCORES")),
                     scorer.build(bus, rewards, ScorerSettings(reward_timeout_s=REWARD_TIMEOUT_S))[0]]
        running = [asyncio.ensure_future(c.run()) for c in consumers]
        mirroring = asyncio.ensure_future(mirror_runs(bus, store, stopping))
        try:
            await bus.publish_many([events.Task(id=f"t-{row['mode']}", run="r1", env="parity_env", data=row,
                                                num_rollouts=NUM_ROLLOUTS) for row in rows])
            num_rewards = len(env.rewards)

            async def all_scored() -> bool:
                lines = await exported(client)
                return len(lines) == len(rows) * NUM_ROLLOUTS and all(
                    len(line["scores"]) == num_rewards for line in lines)

            await until(all_scored, timeout_s=120, what="every rollout recorded with all its scores")
        finally:
            stopping.set()
            for c in consumers:
                c.stop()
            await asyncio.gather(*running, mirroring)
    out = {}
    for r in await exported(client):
        out[(r["task_data"]["mode"], r["index"])] = outcome(r["status"], r["error"], r["state"], r["scores"],
                                                            r["reward"])
    return out


async def in_eval(tmp_path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    env = load_environment("parity_env")
    assert isinstance(env.tasks, TaskSet) and env.tasks.size is not None  # a list of rows
    with ScriptedOpenAI({"agent": ["noise"] * 100}) as server:
        cfg = EvalConfig(env="parity_env", model="agent", base_url=server.base_url, out=tmp_path / "eval.jsonl",
                         num_tasks=env.tasks.size, num_rollouts=NUM_ROLLOUTS,
                         rollout_timeout_s=ROLLOUT_TIMEOUT_S, reward_timeout_s=REWARD_TIMEOUT_S)
        async with worker_pool("eval") as workers:
            loaded = await runs.load_environment(workers, "parity_env")
            await Evaluation(cfg, loaded, (tmp_path / "progress.txt").open("w")).run()
    out = {}
    for r in read_results(cfg.out):
        scores = [{"scorer": name, "value": value, "error": None} for name, value in r["rewards"].items()]
        scores += [{"scorer": name, "value": 0.0, "error": error} for name, error in r["reward_errors"].items()]
        # The trace API shows a rollout's error as why it is one (its own message, then each
        # failed scorer's): eval's, shown the same way, is what training's must equal.
        shown = shown_error(r["status"], r["error"], scores)
        out[(r["task"]["mode"], r["index"])] = outcome(r["status"], shown, r["state"], scores, r["reward"])
    return out


@pytest.mark.long
async def test_an_environment_ends_and_scores_the_same_in_eval_and_in_training(
        app: FastAPI, client: httpx.AsyncClient, store: Store, bus: Bus,
        start_worker: Workers, tiny_model_dir: Path, tmp_path: Path, parity_env: None) -> None:
    evaluated = await in_eval(tmp_path)
    trained = await in_training(app, client, store, bus, start_worker, tiny_model_dir)
    assert trained == evaluated
    # Every way of ending is there, and the same; a few by what they must be:
    play = trained[("play", 0)]
    assert (play["status"], play["state"]["tally"], play["rewards"]["num_messages"]) == ("truncated", 3, 4.0)
    assert play["reward"] == pytest.approx(0.3 + 0.5 + 0.5 + 0.25)
    assert trained[("play", 1)]["reward"] == pytest.approx(0.3 + 0.5 + 0.5)  # not first of its group
    assert trained[("hang", 0)]["error"] == f"the harness ran past rollout_timeout_s={ROLLOUT_TIMEOUT_S}"
    assert trained[("silent", 1)]["error"] == "the harness made no model call"
    assert trained[("board", 0)]["state"] == {} and "the harness's state is not JSON" in trained[("board", 0)]["error"]
    assert trained[("raise", 1)]["error"] == "harness failed: RuntimeError: the game server is down"
    assert trained[("slow_reward", 0)]["reward_errors"] == {"judged": "reward 'judged' timed out after 1s"}
    assert "returned 'nope'" in trained[("bad_reward", 1)]["reward_errors"]["well_formed"]
    assert all(trained[(mode, 0)]["reward"] is None for mode in ("raise", "hang", "silent", "board", "bad_reward",
                                                                   "slow_reward"))
