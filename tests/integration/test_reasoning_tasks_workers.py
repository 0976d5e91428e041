"""reasoning_tasks in a real, sandboxed environment worker (bubblewrap), as every service runs
it: reasoning-gym imports there (its data files read-only, no network), the tasks and prompt
come from the worker, the rollout's harness runs there against a model that answers right, wrong
and unformatted, and reasoning-gym's own scorer scores each rollout there; a bad task name
is refused with the load, naming the valid ones. ``flywheel eval`` on the held-out split."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

import reasoning_tasks
from flywheel.runtime.environments import RolloutLink, WorkerRollout
from flywheel.runtime.envworker import LoadSpec
from flywheel.runtime.evalresults import read_results
from flywheel.runtime.evaluation import EvalConfig, run_eval
from flywheel.sdk.environment import EnvironmentLoadError
from tests.helpers import worker_pool
from tests.scripted_openai import ScriptedOpenAI, make_rollout

ARGS: dict[str, Any] = {"task": "leg_counting", "config": {"min_animals": 2, "max_animals": 3}, "split": "test"}


async def test_reasoning_tasks_roll_out_and_score_in_a_worker() -> None:
    asked: list[dict] = []
    replies: list[str] = []

    async def post(url: str, body: bytes) -> tuple[int, bytes]:
        asked.append(json.loads(body))
        return 200, json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": replies[len(asked) - 1]}}]}).encode()

    async with worker_pool("scorer") as pool:
        env = await pool.load(LoadSpec(env_id="reasoning_tasks", args=ARGS), "a")
        assert env.info.weights == {"score": 1.0, "format": 0.0, "correct": 0.0}
        rows = await env.load_tasks(3, seed=5)
        assert [r["seed"] for r in rows] == [2**31 + 5 * 2**20] * 3 and [r["index"] for r in rows] == [0, 1, 2]
        task = rows[0]
        right = task["answer"]
        replies += [f"Counting.\n<answer>{right}</answer>", f"<answer>{int(right) + 2}</answer>", right]
        rollouts = []
        for i in range(3):
            running = await env.start_rollout(RolloutLink(f"r-{i}", "run", "http://model/v1", "k", post=post))
            assert isinstance(running, WorkerRollout)  # the harness runs in the worker
            ran = await running.run(task, model="m", index=i, timeout_s=60)
            assert ran.error is None and ran.state["stop_reason"] == "done"
            rollouts.append(make_rollout("reasoning_tasks", task, [*asked[i]["messages"],
                                                                   {"role": "assistant", "content": replies[i]}],
                                         index=i))
        system, user = asked[0]["messages"]
        assert system["role"] == "system" and "<answer>" in system["content"] and user["content"] == task["question"]
        outcomes = await env.score(rollouts, ["score", "format", "correct"], timeout_s=60)
        assert [[(o.name, o.value, o.error) for o in row] for row in outcomes] == [
            [("score", 1.0, None), ("format", 1.0, None), ("correct", 1.0, None)],  # right
            [("score", 0.0, None), ("format", 1.0, None), ("correct", 0.0, None)],  # wrong
            [("score", 0.0, None), ("format", 0.0, None), ("correct", 0.0, None)],  # no answer tags
        ]
        with pytest.raises(EnvironmentLoadError, match=r"task='leg_countin' is not a reasoning-gym .*leg_counting"):
            await pool.load(LoadSpec(env_id="reasoning_tasks", args={"task": "leg_countin"}), "a")


async def test_flywheel_eval_on_the_held_out_split(tmp_path: Path) -> None:
    rows = reasoning_tasks.load_environment(**ARGS).load_tasks(2, seed=0)  # what the eval draws
    replies = [f"<answer>{rows[0]['answer']}</answer>", f"<answer>{int(rows[1]['answer']) + 1}</answer>"]
    with ScriptedOpenAI({"agent": replies}) as model:
        cfg = EvalConfig(env="reasoning_tasks", model="agent", base_url=model.base_url, out=tmp_path / "rg.jsonl",
                         num_tasks=2, concurrency=1, env_args=ARGS)
        summary = await run_eval(cfg, "nats://127.0.0.1:1", io.StringIO())
    assert summary["num_errors"] == 0 and summary["num_reward_errors"] == 0, read_results(cfg.out)
    by_question = {r["task"]["question"]: r for r in read_results(cfg.out)}
    right, wrong = by_question[rows[0]["question"]], by_question[rows[1]["question"]]
    assert right["rewards"] == {"score": 1.0, "format": 1.0, "correct": 1.0}
    assert wrong["rewards"] == {"score": 0.0, "format": 1.0, "correct": 0.0}
    assert summary["reward_mean"] == 0.5
