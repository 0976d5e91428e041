"""A run's owner in the orchestrator, against a real nats-server: a run taken over from a dead
owner waits for that owner's trainer, still beating, before it starts another (two trainers of
one run would write one checkpoint folder); heartbeats of gone processes and of other runs'
trainers do not hold it."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.runs import claim_run, get_run, register_run
from flywheel.contract.settings import Settings
from flywheel.ops.natsserver import NatsServer
from flywheel_orchestrator.owner import RunOwner
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
