"""Fair sharing of inference: a tenant's run that waits holds only what is its own.

Mallory's run is paused (its trainer stopped: no new weights, so its admission stays full) and
has a flood of tasks queued ahead of everyone's in the TASKS stream. Alice's run, another
tenant's on the same inference process, keeps getting its rollouts step after step; the paused
run holds no more than its own ``max_tasks_in_flight`` slots, says what it waits for, and its
flood waits on the bus, where it holds nothing. Stopped, it lets go of all of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, read_stream
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import InferenceSettings
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk import models
from tests.helpers import until
from tests.integration.services import Workers
from tests.integration.test_inference_worker import publish_weights

FLOOD = 400  # mallory's queued tasks, ahead of alice's in the stream
SLOTS = 4  # inference.max_tasks_in_flight: each run's
STEPS = 4  # alice's trainer steps while mallory's run is paused


@pytest.fixture
async def start_worker(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Workers]:
    workers = Workers(nats_server.url, tmp_path / "data")
    yield workers
    for _, _, worker in list(workers.started.values()):
        await workers.stop(worker)


async def register(bus: Bus, model_dir: Path, run: str, tenant: str, paused: bool = False) -> events.RunState:
    """A run of ``tenant``: groups of 4, 8 rollouts a step, no lookahead (2 groups a weights version)."""
    cfg = RunConfig.parse({"run": run, "env": "reverse_text", "group_size": 4, "model": {"name": str(model_dir)},
                           "sampling": {"max_tokens": 4}, "trainer": {"batch_size": 8, "max_off_policy_steps": 0}})
    state = events.RunState(id=run, tenant=tenant, status="paused" if paused else "running", config=cfg.model_dump())
    await (await bus.runs_kv()).put(run, events.encode(state))
    return state


def tasks(run: str, n: int) -> list[events.Task]:
    return [events.Task(id=f"{run}-t{i}", run=run, env="reverse_text", data={"text": "abcd"}, num_rollouts=4)
            for i in range(n)]


async def rollouts_of(bus: Bus, run: str) -> int:
    return sum(1 for r in await read_stream(bus, "ROLLOUTS", events.Rollout) if r.run == run)


async def count_is(bus: Bus, run: str, n: int) -> bool:
    found = await rollouts_of(bus, run)
    assert found <= n, f"{found} rollouts of {run}, more than the {n} its weights admit"
    return found == n


async def test_a_paused_run_flooded_with_tasks_leaves_another_tenant_s_run_its_rollouts(
        bus: Bus, tiny_model_dir: Path, start_worker: Workers) -> None:
    base, _ = models.load_model(tiny_model_dir)
    paused = await register(bus, tiny_model_dir, "hog", "mallory", paused=True)
    await register(bus, tiny_model_dir, "victim", "alice")
    await publish_weights(bus, "hog", 0, base)
    await publish_weights(bus, "victim", 0, base)
    worker = await start_worker(InferenceSettings(max_tasks_in_flight=SLOTS, backoff_s=(0.2,), max_deliver=50))
    await bus.publish_many(tasks("hog", FLOOD))
    await bus.publish_many(tasks("victim", 2 * (STEPS + 1)))  # behind the flood

    # Alice's run trains on: each version its trainer publishes lets in one more step's groups.
    for version in range(STEPS + 1):
        if version:
            await publish_weights(bus, "victim", version, base)
        await until(lambda v=version: count_is(bus, "victim", 8 * (v + 1)), timeout_s=20,  # type: ignore[misc]
                    what=f"alice's rollouts of weights version {version}")

    # Mallory's paused run got its one step's worth, and waits holding its own slots only.
    assert await rollouts_of(bus, "hog") == 8
    hog = worker.info["runs"]["hog"]
    assert hog["num_issued"] == hog["max_issued"] == 8 and hog["num_waiting"] == 4 * SLOTS, hog
    assert hog["tenant"] == "mallory" and worker.info["runs"]["victim"]["tenant"] == "alice"
    held = await bus.js.consumer_info("TASKS", "inference-hog")
    assert held.num_ack_pending == SLOTS and held.num_pending == FLOOD - 2 - SLOTS, held
    screen = await bus.js.consumer_info("TASKS", "inference")
    assert screen.num_ack_pending == 0 and screen.num_pending == 0, screen  # the flood passed the screen
    assert await read_stream(bus, "DEAD") == []

    # Stopped, the run lets go of its waiting tasks at once, and of the flood as it is skipped.
    stopped = msgspec.structs.replace(paused, status="stopped", ended_at=events.utc_now(), reason="stopped by mallory",
                                      updated_at=events.utc_now())
    await (await bus.runs_kv()).put("hog", events.encode(stopped))

    async def let_go() -> bool:
        info = await bus.js.consumer_info("TASKS", "inference-hog")
        return info.num_ack_pending == 0 and info.num_pending == 0

    await until(let_go, timeout_s=30, what="the stopped run's tasks skipped")
    await until(lambda: "hog" not in worker.tasks.runs(), what="its consumer stopped")
    assert worker.info["runs"]["hog"]["num_skipped"] == 4 * (FLOOD - 2)
    assert await rollouts_of(bus, "hog") == 8 and await read_stream(bus, "DEAD") == []

