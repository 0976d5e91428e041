"""A trainer SIGKILLed in the middle of a run still trains every published rollout exactly once.

``python -m flywheel_trainer --run RUN`` runs as a subprocess against the test's
nats-server, the way ``flywheel run`` starts it. The test plays inference and the
scorers (see test_trainer_bus.py). First kill: once the trainer has acknowledged
rollouts it has not trained (a group beyond the step, a group still waiting for its
scores), so only its journal holds them. Second kill: as soon as version 4 is out, with
the data of every remaining step already acknowledged, so it lands wherever the trainer
is (mid-step, between checkpoint and publish, or already done). Then the checkpoint's
trained ids, metrics.jsonl and the WEIGHTS stream must show each rollout trained once,
each step once, each version once.

With ``checkpoint_every = 2`` a kill loses a published step: the restart republishes its
checkpoint's weights under a new version (no version number names two sets of weights),
trains the lost step again, and a SIGTERM then checkpoints before the process exits 0.

Only the processes these tests start are stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from flywheel.contract import weights
from flywheel.contract.bus import Bus
from flywheel.contract.runs import get_run, register_run
from flywheel.contract.settings import Settings, TrainerSettings
from flywheel.runtime.natsserver import NatsServer
from flywheel.runtime.supervise import child_env
from flywheel_trainer.ledger import RunFolder
from tests.helpers import until
from tests.integration.test_trainer_bus import Inference, run_config, weight_updates
from tests.unit.test_trainer_join import make_score

RUN = "trainer-kill"
NUM_STEPS = 6  # of 2 groups of 2 rollouts


class TrainerProcess:
    def __init__(self, env: dict[str, str], log_path: Path, run: str) -> None:
        self.env = env
        self.run = run
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", "flywheel_trainer", "--run", self.run], env=self.env,
                                          stdout=log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        assert self.popen is not None
        code = self.popen.poll()
        assert code is None, f"trainer exited with {code}:\n{self.log_path.read_text()[-3000:]}"
        return True

    async def kill(self, sig: signal.Signals = signal.SIGKILL) -> int:
        assert self.popen is not None
        os.kill(self.popen.pid, sig)
        return await asyncio.to_thread(self.popen.wait)

    async def wait(self, timeout_s: float) -> int:
        assert self.popen is not None
        return await asyncio.wait_for(asyncio.to_thread(self.popen.wait), timeout_s)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    async def published(self, bus: Bus, version: int) -> None:
        """Wait until weights ``version`` is out (failing at once if the trainer died)."""

        async def out() -> bool:
            return self.alive() and any(u.version >= version for u in await weight_updates(bus, self.run))

        await until(out, timeout_s=90, what=f"weights version {version}")


async def new_run(bus: Bus, nats_server: NatsServer, model_dir: Path, tmp_path: Path, run: str,
                  **trainer: object) -> tuple[TrainerProcess, Inference, Settings]:
    """Register ``run``; a trainer process for it (not started) and a stand-in for inference."""
    await register_run(bus, run, config=run_config(model_dir, run=run, **trainer).model_dump())
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    return TrainerProcess(child_env(settings), tmp_path / "trainer.log", run), Inference(bus, model_dir, run), settings


async def all_acknowledged(bus: Bus, run: str = RUN) -> bool:
    for stream, kind in (("ROLLOUTS", "rollouts"), ("SCORES", "scores")):
        info = await bus.js.consumer_info(stream, f"trainer-{run}-{kind}")
        if info.num_pending or info.num_ack_pending:
            return False
    return True


@pytest.mark.long
async def test_every_rollout_is_trained_exactly_once_across_two_sigkills(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer, inference, settings = await new_run(bus, nats_server, tiny_model_dir, tmp_path, RUN,
                                                 num_steps=NUM_STEPS, max_off_policy_steps=NUM_STEPS)
    try:
        trainer.start()
        await trainer.published(bus, 0)
        for g in range(7):  # 3 steps, plus one group more
            await inference.group(f"g{g}", 0)
        waiting = [inference.rollout(f"g7-{i}", "g7", 0) for i in range(2)]
        await bus.publish_many(waiting)
        inference.published += [r.id for r in waiting]
        await trainer.published(bus, 3)
        await until(lambda: all_acknowledged(bus), timeout_s=30, what="everything acknowledged")
        await trainer.kill()

        await bus.publish_many([make_score(r, name, 0.5) for r in waiting for name in ("similarity", "exact")])
        for g in range(8, 12):
            await inference.group(f"g{g}", 0)
        trainer.start()
        await until(lambda: all_acknowledged(bus), timeout_s=90, what="everything acknowledged after the restart")
        await trainer.published(bus, 4)
        await trainer.kill()

        trainer.start()
        assert await trainer.wait(timeout_s=90) == 0, trainer.log_path.read_text()[-3000:]
    finally:
        trainer.stop()

    folder = RunFolder(settings.data_dir, RUN)
    latest = folder.checkpoints.latest()
    assert latest is not None  # the run saved a checkpoint
    _, checkpoint = latest
    trained = [rollout_id for step in sorted(checkpoint.trained) for rollout_id in checkpoint.trained[step]]
    assert checkpoint.step == NUM_STEPS and sorted(checkpoint.trained) == list(range(1, NUM_STEPS + 1))
    assert len(trained) == len(set(trained)) == len(inference.published) == 24
    assert set(trained) == set(inference.published) and not checkpoint.dropped
    metrics = folder.metrics.read()
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS + 1))
    assert sum(m.get("num_rollouts", 0) for m in metrics) == 24
    versions = Counter(u.version for u in await weight_updates(bus, RUN))
    assert versions == Counter(range(NUM_STEPS + 1)), "each version published once (a republish is deduplicated)"
    kept = TrainerSettings().weight_versions_kept  # the bucket holds the last ones, whatever the kills
    assert await weights.versions(bus, RUN) == list(range(NUM_STEPS + 1 - kept, NUM_STEPS + 1))
    state = await get_run(bus, RUN)
    assert state is not None and (state.status, state.trainer_step, state.policy_version) == ("finished", 6, 6)
    assert "resuming from" in trainer.log_path.read_text()


@pytest.mark.long
async def test_a_kill_after_an_unsaved_step_never_reuses_its_version_and_sigterm_saves_first(
        bus: Bus, nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    run = "trainer-lossy"
    trainer, inference, settings = await new_run(bus, nats_server, tiny_model_dir, tmp_path, run,
                                                 num_steps=4, max_off_policy_steps=4, checkpoint_every=2)
    try:
        trainer.start()
        await trainer.published(bus, 0)
        for g in range(6):
            await inference.group(f"g{g}", 0)
        await trainer.published(bus, 3)
        await until(lambda: all_acknowledged(bus, run), timeout_s=30, what="everything acknowledged")
        await trainer.kill()  # step 3 was published, never checkpointed

        trainer.start()
        await trainer.published(bus, 5)  # step 3 again
        assert await trainer.kill(signal.SIGTERM) == 0, trainer.log_path.read_text()[-3000:]
        latest = RunFolder(settings.data_dir, run).checkpoints.latest()
        assert latest is not None  # the run saved a checkpoint
        _, checkpoint = latest
        assert (checkpoint.step, checkpoint.version) == (3, 5)

        for g in range(6, 8):
            await inference.group(f"g{g}", 5)  # sampled with version 5, as inference would now
        trainer.start()
        assert await trainer.wait(timeout_s=90) == 0, trainer.log_path.read_text()[-3000:]
    finally:
        trainer.stop()

    updates = await weight_updates(bus, run)
    assert [(u.version, u.trainer_step) for u in updates] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 2), (5, 3), (6, 4)]
    assert updates[4].sha256 == updates[2].sha256  # the checkpoint's weights, under a version of their own
    folder = RunFolder(settings.data_dir, run)
    assert [(m["step"], m["version"]) for m in folder.metrics.read()] == [(0, 0), (1, 1), (2, 2), (3, 5), (4, 6)]
    latest = folder.checkpoints.latest()
    assert latest is not None  # the run saved a checkpoint
    _, checkpoint = latest
    trained = [i for step in sorted(checkpoint.trained) for i in checkpoint.trained[step]]
    assert len(trained) == len(set(trained)) == 16 and set(trained) == set(inference.published)
