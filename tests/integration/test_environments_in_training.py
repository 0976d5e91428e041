"""Every reference environment runs unchanged inside a training run's inference service: its
harness talks to the interception endpoint of a real inference server (the tiny model, real
nats-server), and every rollout comes back well-formed and trainable. Environments are named
by id (``flywheel/<name>``) in the run config, as a user would. The tiny model answers nonsense,
so this checks the plumbing (turns, tools, the user simulator, state), not the rewards; the
environments' own tests check the rewards with scripted answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.sdk import models
from flywheel.sdk.environment import EnvironmentOverrides, load_environment
from flywheel.sdk.tracegraph import branches
from flywheel_trainer.join import sequences_of
from tests.helpers import until
from tests.integration.services import Served
from tests.integration.test_inference_worker import count_is, create_run, publish_weights, stored

CASES: dict[str, dict[str, Any]] = {
    "flywheel/arithmetic": {"difficulty": "easy"},
    "flywheel/wordle": {},
    "flywheel/wiki-search": {"max_turns": 3},
    "flywheel/customer-service": {"max_turns": 3},
}


@pytest.mark.parametrize("env_id", list(CASES))
async def test_a_reference_environment_rolls_out_in_training(env_id: str, bus: Bus, long_tiny_model: Path,
                                                            server: Served) -> None:
    args = dict(CASES[env_id])
    if env_id == "flywheel/customer-service":  # the policy itself plays the customer, through the plain API
        args |= {"user_base_url": f"{server.url}/v1", "user_model": "r1"}
    await create_run(bus, long_tiny_model, env=env_id, env_args=args, group_size=2,
                     sampling={"max_tokens": 12}, trainer={"batch_size": 2, "max_off_policy_steps": 0})
    env = load_environment(env_id, EnvironmentOverrides(args=args))
    base, _ = models.load_model(long_tiny_model)
    await publish_weights(bus, "r1", 0, base)
    (row,) = env.load_tasks(1, seed=0)
    await bus.publish(events.Task(id="t0", run="r1", env=env.name, data=row, num_rollouts=2))
    await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=180, what="2 rollouts")
    for r in await stored(bus, "ROLLOUTS", events.Rollout):
        assert r.status in ("completed", "truncated"), r.error
        assert r.metrics["num_calls"] >= 1 and r.metrics["num_rerenders"] == 0
        assert sequences_of(r) and all(n.tokens is not None for n in r.nodes)
        assert [n.message.role for n in branches(r.nodes)[-1]][-1] == "assistant"
