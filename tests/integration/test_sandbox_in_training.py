"""A sandbox environment inside a training run: the inference service hands each rollout's harness
a sandbox client over its own bus, the ctf harness plants its flag in a real sandbox (local
backend, real nats-server), and the sandbox is gone once the rollout is published. The tiny
model answers nonsense: this checks the plumbing; the environment's own tests check solving."""

from __future__ import annotations

import pytest

from flywheel import events, models
from flywheel.bus import Bus
from tests.helpers import until
from tests.integration.test_environments_in_training import long_tiny_model  # noqa: F401 - the fixture
from tests.integration.test_inference_worker import count_is, create_run, publish_weights, stored
from tests.integration.test_interception import Served, server  # noqa: F401 - the fixture
from tests.sandbox_service import backend_named, serving


async def test_ctf_rollouts_in_training_plant_their_flag_and_leave_no_sandbox(
        bus: Bus, long_tiny_model, server: Served, request: pytest.FixtureRequest) -> None:  # noqa: F811
    async with backend_named("local", request) as backend, serving(bus, backend, warm_pool=1) as sandbox:
        await create_run(bus, long_tiny_model, env="flywheel/ctf", env_args={"max_turns": 2}, group_size=2,
                         sampling={"max_tokens": 12}, trainer={"batch_size": 2, "max_off_policy_steps": 0})
        base, _ = models.load_model(long_tiny_model)
        await publish_weights(bus, "r1", 0, base)
        row = {"id": "hex-dump", "challenge": "hex_dump", "prompt": "A process dumped memory as hex digits."}
        await bus.publish(events.Task(id="t0", run="r1", env="ctf", data=row, num_rollouts=2))
        await until(lambda: count_is(bus, "ROLLOUTS", 2), timeout_s=180, what="2 rollouts")
        rollouts = await stored(bus, "ROLLOUTS", events.Rollout)
        for r in rollouts:
            assert r.status in ("completed", "truncated"), r.error
            assert len(r.state["flag_sha256"]) == 64 and r.state["submissions"] == []  # planted in its sandbox
        assert rollouts[0].state["flag_sha256"] != rollouts[1].state["flag_sha256"]  # a flag per rollout
        assert not sandbox.manager.sessions and len(sandbox.manager.tombstones) == 2  # both made, both destroyed
