"""Two inference replicas share one run's admission bound (the real services).

``flywheel up`` runs one inference replica; the test starts a second (``python -m
flywheel_inference`` on another port), then ``flywheel run`` trains against the stack. While
it runs, the run's rollouts in the ROLLOUTS stream (the truth of what was issued and stored)
are counted, then the latest weight update read: the count must never pass what one replica
alone may issue at that version, ``(version + max_off_policy_steps + 1) * batch_size +
dropped``. Each replica counts against the same entry of the admission bucket; with a count
of its own each, two replicas issue up to twice that. Both replicas must have sampled, and
no trained rollout may be staler than the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import nats.js.errors
import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, decode_message
from flywheel.contract.settings import Settings
from flywheel.ops.natsserver import free_port
from tests.e2e.test_up import Output

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "reverse-text.toml"
NUM_STEPS = 12
BATCH_SIZE = 64  # the example's trainer.batch_size
OFF_POLICY = 1  # its max_off_policy_steps
READY_TIMEOUT_S = 120


async def watch_bound(settings: Settings, run: str, done: asyncio.Event,
                      sampling: set[int]) -> list[tuple[int, int, int]]:
    """(rollouts stored, version, bound) every 0.1 s until ``done``; asserts the bound each time.
    Adds to ``sampling`` the pid of each inference replica seen holding rollouts of ``run`` (in
    the admission bucket's entry of the run: replicas are named ``<host>-<pid>-<random>``)."""
    bus = await Bus.for_settings(settings, "test-bound")
    admission = await bus.admission_kv()
    decoder: events.Decoder[events.WeightUpdate] = events.Decoder(events.WeightUpdate)
    seen: list[tuple[int, int, int]] = []
    try:
        while not done.is_set():
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = json.loads((await admission.get(run)).value or b"{}")
                sampling.update(int(replica.split("-")[-2]) for replica in entry["held"])
            info = await bus.js.stream_info("ROLLOUTS", subjects_filter=f"rollouts.{run}.>")
            stored = sum((info.state.subjects or {}).values())
            try:  # read after the count: the bound can only be larger than when they were admitted
                update = decode_message(decoder, await bus.js.get_last_msg("WEIGHTS", f"weights.{run}"))
            except nats.js.errors.NotFoundError:
                assert stored == 0, f"{stored} rollouts before any weights"
            else:
                bound = (update.version + OFF_POLICY + 1) * BATCH_SIZE + update.num_dropped_total
                seen.append((stored, update.version, bound))
                assert stored <= bound, f"{stored} rollouts stored at version {update.version}: bound {bound}"
            await asyncio.sleep(0.1)  # noqa: sleep - the sampling interval of this watch
    finally:
        await bus.close()
    return seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_inference_replicas_never_issue_past_one_runs_bound(
        tmp_path: Path, stack: tuple[subprocess.Popen[str], Output, dict[str, int]], clean_env: dict[str, str]) -> None:
    _, output, ports = stack
    output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    data_dir = tmp_path / "data"
    env = clean_env | {"FLYWHEEL_NATS_PORT": str(ports["nats"]), "FLYWHEEL_GATEWAY_PORT": str(ports["gateway"])}
    second = subprocess.Popen([sys.executable, "-m", "flywheel_inference", "--port", str(free_port())], env=env,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "inference-2.log").open("w"), cwd=ROOT)
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", "replicas", "--data-dir",
             str(data_dir), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
             "--inference-port", str(ports["inference"]), "--set", f"trainer.num_steps={NUM_STEPS}",
             "--set", "sft.steps=20"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        settings = Settings(data_dir=data_dir, nats_port=ports["nats"])

        sampling: set[int] = set()

        async def watch() -> list[tuple[int, int, int]]:
            done = asyncio.Event()
            watcher = asyncio.ensure_future(watch_bound(settings, "replicas", done, sampling))
            ended = asyncio.ensure_future(asyncio.to_thread(run.wait, 420))
            await asyncio.wait([watcher, ended], return_when=asyncio.FIRST_COMPLETED)  # a broken bound ends it
            done.set()
            return await watcher

        seen = asyncio.run(watch())
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0, out[-4000:]
    finally:
        second.terminate()
        second.wait(timeout=30)
    assert len(seen) > 20 and seen[-1][1] >= NUM_STEPS - 1, seen[-5:]
    lines = [json.loads(line) for line in (data_dir / "runs" / "replicas" / "metrics.jsonl").read_text().splitlines()]
    assert all(line["staleness_max"] <= OFF_POLICY for line in lines if line["step"] > 0)
    assert second.pid in sampling and len(sampling) == 2, sampling  # both replicas sampled the run
