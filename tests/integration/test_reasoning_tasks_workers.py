"""reasoning_tasks in a real, sandboxed environment worker (bubblewrap), as every service runs
it: reasoning-gym imports there (its data files read-only, no network), the tasks and prompt
come from the worker, the rollout's harness runs there against a model that answers right, wrong
and unformatted, and reasoning-gym's own scorer scores each rollout there; a bad task name
is refused with the load, naming the valid ones."""

from __future__ import annotations

import json

import pytest

from flywheel.runtime.environments import RolloutLink, WorkerRollout
from flywheel.runtime.envworker import LoadSpec
from flywheel.sdk.environment import EnvironmentLoadError
from tests.helpers import worker_pool
from tests.scripted_openai import make_rollout

ARGS = {"task": "leg_counting", "config": {"min_animals": 2, "max_animals": 3}, "split": "test"}


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
