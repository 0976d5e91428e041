"""A run's owner in the orchestrator, against a real nats-server: a run taken over from a dead
owner waits for that owner's trainer, still beating, before it starts another (two trainers of
one run would write one checkpoint folder); heartbeats of gone processes and of other runs'
trainers do not hold it."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.runs import claim_run, get_run, register_run, task_durable
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.runs import load_run_environments
from flywheel_orchestrator.owner import STALL_S, RunOwner
from tests.helpers import until
from tests.inprocess import InProcessPool


async def beat(bus: Bus, key: str, pid: int, run: str) -> None:
    heartbeat = events.ServiceHeartbeat(service="trainer", instance=key, pid=pid, host=socket.gethostname(),
                                        started_at=events.utc_now(), info={"run": run})
    await (await bus.services_kv()).put(f"trainer.{key}", events.encode(heartbeat))


async def test_a_run_taken_over_waits_for_the_previous_trainer(bus: Bus, nats_server: NatsServer,
                                                                tmp_path: Path) -> None:
    await register_run(bus, "r", config={"run": "r", "env": "reverse_text"})
    state = await claim_run(bus, "r", "orchestrator me", 60.0)
    assert state is not None
    owner = RunOwner(bus, Settings(nats_url=nats_server.url, data_dir=tmp_path), state, "orchestrator me",
                     InProcessPool())
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()
    await beat(bus, "gone", gone.pid, "r")  # killed: its heartbeat lingers, it does not count
    await beat(bus, "other-run", os.getpid(), "another")
    await asyncio.wait_for(owner._wait_for_previous_trainer(), 5)  # nothing to wait for

    await beat(bus, "old", os.getpid(), "r")  # alive, of this run: still checkpointing on its way out
    waiting = asyncio.ensure_future(owner._wait_for_previous_trainer())

    async def said() -> bool:
        found = await get_run(bus, "r")
        return found is not None and any("waiting for the run's previous trainer" in n for n in found.notes)

    await until(said, what="the wait said on the run")
    assert not waiting.done()
    await (await bus.services_kv()).delete("trainer.old")  # it stopped: its heartbeat went with it
    await asyncio.wait_for(waiting, 5)


async def run_tasks_held(bus: Bus, run: str) -> int:
    held = await bus.js.stream_info("TASKS", subjects_filter=f"tasks.{run}.>")
    return sum((held.state.subjects or {}).values())


async def supplying_owner(bus: Bus, nats_server: NatsServer, tmp_path: Path) -> RunOwner:
    """The owner of a claimed run "r" of 10 steps of 4 rollouts (groups of 2), its environment loaded."""
    config = {"run": "r", "env": "reverse_text", "trainer": {"num_steps": 10, "batch_size": 4}, "group_size": 2}
    await register_run(bus, "r", config=config)
    state = await claim_run(bus, "r", "orchestrator me", 60.0)
    assert state is not None
    owner = RunOwner(bus, Settings(nats_url=nats_server.url, data_dir=tmp_path), state, "orchestrator me",
                     InProcessPool())
    owner.environments = await load_run_environments(owner.pool, owner.cfg)
    owner.rows = [[] for _ in owner.environments]
    return owner


async def test_tasks_gone_from_the_bus_are_published_again_once(bus: Bus, nats_server: NatsServer,
                                                                tmp_path: Path) -> None:
    """TASKS purged under a running run: the owner finds none of the run's tasks there and
    publishes what the run still needs, at new positions (new tasks, so nothing trained twice),
    once. Tasks lost otherwise (none waiting, none being rolled out, no step for STALL_S):
    published again once a stall."""
    owner = await supplying_owner(bus, nats_server, tmp_path)
    await owner._publish_tasks()
    first = owner.num_published
    assert first and await run_tasks_held(bus, "r") == first
    await owner._reconcile()  # all there: nothing more
    assert owner.num_published == first

    owner.trainer_step = 4  # four steps trained, then the stream is purged
    await bus.js.purge_stream("TASKS")
    await owner._reconcile()
    # The 6 steps left, with the same slack as at the start (groups of 2: 2 tasks a step).
    needed = (10 - 4 + owner.cfg.trainer.max_off_policy_steps + 2) * owner.cfg.groups_per_step
    assert owner.num_published == first + needed
    assert await run_tasks_held(bus, "r") == needed
    found = await get_run(bus, "r")
    assert found is not None and found.num_tasks_published == first + needed
    assert any("TASKS stream holds none of the" in n for n in found.notes)
    before = {t.id for t in await owner._tasks(0, first)}
    assert not before & {t.id for t in await owner._tasks(first, first + needed)}
    await owner._reconcile()  # they are there now: once
    assert owner.num_published == first + needed

    # Every task consumed and acked, no step for STALL_S: lost some other way; reissued once.
    durable = task_durable("r")
    sub = await bus.js.pull_subscribe("tasks.r.>", durable=durable, stream="TASKS")
    while (await bus.js.consumer_info("TASKS", durable)).num_pending:
        for msg in await sub.fetch(100, timeout=2):
            await msg.ack_sync()
    await owner._reconcile()  # a step came recently: nothing
    assert owner.num_published == first + needed
    owner.last_step_at -= STALL_S
    await owner._reconcile()
    assert owner.num_published == first + 2 * needed
    found = await get_run(bus, "r")
    assert found is not None and any("no task of the run waits" in n for n in found.notes)
    while (await bus.js.consumer_info("TASKS", durable)).num_pending:
        for msg in await sub.fetch(100, timeout=2):
            await msg.ack_sync()
    await owner._reconcile()  # the same stall: once
    assert owner.num_published == first + 2 * needed


async def test_a_forged_drop_count_adds_no_more_tasks_than_could_have_been_dropped(
        bus: Bus, nats_server: NatsServer, tmp_path: Path) -> None:
    """Drop counts are bounded where they are read: from one update to the next, at most what
    inference could issue past the trainer meanwhile; a step past the run's last is not of its
    trainer at all."""
    owner = await supplying_owner(bus, nats_server, tmp_path)
    await owner._publish_tasks()
    await owner._publish_tasks(2, trainer_step=3)  # a real update: one group dropped
    assert owner.num_unused == 2
    before = owner.num_published
    await owner._publish_tasks(10**12, trainer_step=4)  # one step later: at most (1 + 1 + 1) x 4 more
    most = 2 + (1 + owner.cfg.trainer.max_off_policy_steps + 1) * 4
    assert owner.num_unused == most
    assert owner.num_published - before == -(-(most - 2) // 2)
    found = await get_run(bus, "r")
    assert found is not None and any(f"says {10**12} rollouts were consumed untrained" in n for n in found.notes)
    assert owner.cfg.foreign_step(11) is not None and owner.cfg.foreign_step(10) is None


async def test_a_lease_renewed_after_it_lapsed_is_found(bus: Bus, nats_server: NatsServer, tmp_path: Path) -> None:
    """An owner that could not renew its lease in time (the bus refusing writes: a full disk)
    and renews it later finds the lapse: inference may have released the run's tasks
    meanwhile, and the owner publishes them again."""
    await register_run(bus, "r", config={"run": "r", "env": "reverse_text"})
    state = await claim_run(bus, "r", "orchestrator me", 1.0)
    assert state is not None
    owner = RunOwner(bus, Settings(nats_url=nats_server.url, data_dir=tmp_path, run_lease_s=1.0), state,
                     "orchestrator me", InProcessPool())
    renewing = asyncio.ensure_future(owner._renew_lease(asyncio.Event()))
    try:
        await asyncio.sleep(0.8)  # noqa: sleep - renewed in time, twice: no lapse
        assert owner.lease_lapsed_at is None
        owner.lease_expires_at = events.utc_now() - timedelta(seconds=1)  # as if the last renewals had failed
        await until(lambda: owner.lease_lapsed_at is not None, timeout_s=5, what="the lapse found")
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
