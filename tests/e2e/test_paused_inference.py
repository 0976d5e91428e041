"""Inference paused (SIGSTOP) for longer than the run lease, then resumed (SIGCONT), keeps the
run's waiting tasks: the run finishes.

While inference is stopped, the run's owner (the stack's orchestrator) goes on renewing the
run's lease, but inference's kept copy of the run state still holds the lease it saw before
the pause: by that copy and the wall clock, the lease lapsed long ago, and the run-state
watcher has not yet delivered the renewals buffered on its socket. Inference must re-read the
runs bucket before it acts on such a lapse (``RunStates.confirm_lapse``); acting on the kept
copy instead ends the run in inference's eyes and releases (acks) every task waiting for the
run's admission as "not sampled": when those are more than the task supply's spare, the
trainer waits for rollouts that never come.

A real ``flywheel up`` stack with a short run lease (``FLYWHEEL_RUN_LEASE_S``, in every
process's environment) and a short run of the shipped example config; once the run trained
a couple of steps with tasks waiting in inference, inference is stopped for PAUSE_LEASES
leases, then continued. The run must finish every step within a bound on the tasks first
published (none published again), inference must be the same process throughout (not
restarted by the stack, which would hide the bug), its log must not say the run was
abandoned (the lapse it releases tasks on) nor leave a task unsampled before the run
finished, and the trainer must have dropped no rollout. The in-process version of this (a stale cache simulated) is in
tests/integration/test_inference_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import get_run
from flywheel.contract.service import read_heartbeats
from tests.e2e.test_up import READY_TIMEOUT_S, Output, nats_login, poll
from tests.e2e.test_up_supervisor import alive

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "reverse-text.toml"
RUN = "paused"
LEASE_S = 6.0  # the run lease (the default is 60 s): the orchestrator renews it every third of it
PAUSE_LEASES = 2.5  # inference stays stopped this many leases: its kept lease has lapsed by far
NUM_STEPS = 40  # enough left after the pause that it lands mid-run on a fast machine too (12 was not, here)
PAUSE_AFTER_STEP = 2
STEP_TIMEOUT_S = 240.0  # model load, the SFT warm-up and the first steps on a busy two-core machine
WAITING_TIMEOUT_S = 60.0  # for inference to hold tasks of the run waiting for its admission
# After SIGCONT: the steps left, a second or so each on two cores. A run whose waiting tasks
# were released waits for their rollouts (when the supply's spare tasks do not cover them)
# until its owner sees the stall (flywheel_orchestrator.owner.STALL_S, 60 s without a step)
# and publishes tasks again: the supply's count must not have moved (checked below).
FINISH_TIMEOUT_S = 120.0


@pytest.fixture
def clean_env(clean_env: dict[str, str]) -> dict[str, str]:
    """Every process here, the stack's orchestrator and inference included, with a short run lease."""
    return clean_env | {"FLYWHEEL_RUN_LEASE_S": str(LEASE_S)}


async def _with_bus(nats_url: str, read: Any) -> Any:
    bus = await Bus.connect(nats_url, "test-paused-inference", ensure=False)
    try:
        return await read(bus)
    finally:
        await bus.close()


def run_state(nats_url: str) -> events.RunState:
    found = asyncio.run(_with_bus(nats_url, lambda bus: get_run(bus, RUN)))
    assert found is not None, f"run {RUN} is not in the runs bucket"
    return found


def inference_counters(nats_url: str, pid: int) -> dict[str, Any]:
    """The run's admission counters in the last heartbeat of inference ``pid`` ({} before it hosts the run)."""
    beats = asyncio.run(_with_bus(nats_url, read_heartbeats))
    for beat in beats:
        if beat.service == "inference" and beat.pid == pid:
            return dict(beat.info.get("runs", {}).get(RUN, {}))
    return {}


@pytest.fixture
def stopped_resumed() -> Iterator[list[int]]:
    """Pids this test stopped: each is continued after the test whatever happened, so the stack
    fixture's stop (SIGINT, then SIGKILL) finds no stopped process."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


# About 35 s on two cores (the stack, the SFT warm-up, 40 steps and the 15 s pause): the long tier.
@pytest.mark.timeout(600)
@pytest.mark.long
def test_inference_stopped_longer_than_the_run_lease_keeps_the_runs_waiting_tasks(
        stack: tuple[subprocess.Popen[str], Output, dict[str, int]], tmp_path: Path, clean_env: dict[str, str],
        stopped_resumed: list[int]) -> None:
    _, up_output, ports = stack
    up_output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    data_dir = tmp_path / "data"
    nats = nats_login(data_dir, ports["nats"])
    [started] = up_output.matching(r"^started inference \(pid (\d+)\)")
    inference = int(started.group(1))

    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", RUN, "--data-dir", str(data_dir),
            "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
            "--inference-port", str(ports["inference"]), "--set", f"trainer.num_steps={NUM_STEPS}",
            "--set", "sft.steps=20"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env, cwd=ROOT)
    output = Output(proc)
    try:
        output.wait_for(rf"^step\s+{PAUSE_AFTER_STEP}/{NUM_STEPS}\s", STEP_TIMEOUT_S)
        before = run_state(nats)
        assert before.status == "running" and before.owner and before.owner.startswith("orchestrator "), before

        # Tasks of the run wait in inference (for the run's admission bound or a rollout place): the
        # ones the bug releases. Stopped at once after a heartbeat says so.
        counters: dict[str, Any] = {}

        def tasks_waiting() -> bool:
            counters.update(inference_counters(nats, inference))
            return counters.get("num_waiting", 0) > 0

        poll(tasks_waiting, WAITING_TIMEOUT_S, f"inference to hold tasks of run {RUN} waiting for its admission")
        assert counters["num_skipped"] == 0 and counters["ended"] is None, counters
        os.kill(inference, signal.SIGSTOP)
        stopped_resumed.append(inference)
        paused_at = time.monotonic()
        time.sleep(PAUSE_LEASES * LEASE_S)  # noqa: sleep - the pause itself: inference is stopped this long
        during = run_state(nats)
        os.kill(inference, signal.SIGCONT)
        # The owner went on renewing the lease: only inference's kept copy says it lapsed.
        assert before.lease_expires_at is not None and during.lease_expires_at is not None
        assert during.status == "running" and during.owner == before.owner, during
        assert during.lease_expires_at > before.lease_expires_at, (before, during)
        assert before.lease_expires_at.timestamp() < time.time() - LEASE_S, "the kept lease should have lapsed"
        print(f"inference (pid {inference}) stopped for {time.monotonic() - paused_at:.1f}s "
              f"({PAUSE_LEASES} leases of {LEASE_S:g}s)")

        try:
            output.wait_for(rf"^step\s+{NUM_STEPS}/{NUM_STEPS}\s", FINISH_TIMEOUT_S)
        except AssertionError as exc:
            raise AssertionError(f"run {RUN} did not finish within {FINISH_TIMEOUT_S:g}s after inference was "
                                 f"continued (its waiting tasks released?): {exc}") from None
        assert output.exit_status(proc, 60) == 0, output.text
        after = run_state(nats)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # The task supply published once: no task was lost and published again (the owner's
    # re-supply after STALL_S without a step, or to replace dropped rollouts).
    assert after.status == "finished", after
    assert after.num_tasks_published == before.num_tasks_published > 0, (before, after)
    assert not output.matching(r"steps left|tasks lost|to replace dropped rollouts"), output.text

    # Every step trained once, on a whole batch, none dropped.
    rows = [json.loads(line) for line in (data_dir / "runs" / RUN / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["version"]) for row in rows] == [(i, i) for i in range(NUM_STEPS + 1)]
    batch_size = RunConfig.from_toml(CONFIG).trainer.batch_size
    assert [row["num_rollouts"] for row in rows[1:]] == [batch_size] * NUM_STEPS, rows
    dropped = {key: sum(row.get(key, 0.0) for row in rows) for key in
               ("num_dropped_stale", "num_dropped_scorer_error", "num_dropped_rollout_error",
                "num_dropped_signal_error")}
    assert sum(dropped.values()) == 0, dropped

    # One inference process throughout: the stack did not restart it while it was stopped.
    assert len(up_output.matching(r"^started inference \(pid \d+\)")) == 1, up_output.text
    assert not up_output.matching(r"^inference \(pid \d+\) "), up_output.text
    assert alive(inference)

    # Inference never took the run for abandoned: no release of its waiting tasks on the lapse.
    log = (data_dir / "logs" / "inference.log").read_text(errors="replace")
    abandoned = [line for line in log.splitlines() if f"run '{RUN}' is abandoned" in line]
    assert not abandoned, "\n".join(abandoned[:20])
    released = [line for line in log.splitlines() if "not sampled" in line and f"run '{RUN}' finished" not in line]
    assert not released, "\n".join(released[:20])
