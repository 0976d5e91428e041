"""Two inference replicas share one run's admission bound, and two scorer replicas score whole
groups (the real services).

``flywheel up`` runs one inference replica and one scorer; the test starts a second of each
(``python -m flywheel_inference`` on another port, ``python -m flywheel_scorer``), then
``flywheel run`` trains the arithmetic environment, whose ``shortest_correct`` is a group
reward, against the stack. While
it runs, the run's rollouts in the ROLLOUTS stream (the truth of what was issued and stored)
are counted, then the latest weight update read: the count must never pass what one replica
alone may issue at that version, ``(version + max_off_policy_steps + 1) * batch_size +
dropped``. Each replica counts against the same entry of the admission bucket; with a count
of its own each, two replicas issue up to twice that. Both replicas must have sampled, and
no trained rollout may be staler than the bound. The second scorer is killed (SIGKILL) at
weights version 4, with the partitions split over both; the first must take them all, and
every group reward must be scored without an error: a group split between the scorer replicas,
or lost with the killed one, would be scored incomplete, with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import nats.js.errors
import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, decode_message, read_stream
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import free_port
from tests.e2e.test_up import Output

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "arithmetic.toml"
NUM_STEPS = 12
BATCH_SIZE = 64  # the example's trainer.batch_size
OFF_POLICY = 1  # its max_off_policy_steps
READY_TIMEOUT_S = 120
KILL_AT = 4  # the weights version at which the second scorer replica is killed


async def group_scores(settings: Settings, run: str) -> list[events.Score]:
    """Every ``shortest_correct`` (the group reward) Score of ``run`` (a group's scores travel as one
    batch message: read_stream gives each of them)."""
    bus = await Bus.for_settings(settings, "test-scores")
    try:
        scores = await read_stream(bus, "SCORES", events.Score)
    finally:
        await bus.close()
    return [s for s in scores if s.run == run and s.scorer == "shortest_correct"]


async def partition_owners(bus: Bus) -> set[int]:
    """The pids of the built-in scorer's replicas that own a rollout partition now."""
    partitions = await bus.partitions_kv()
    owners = set()
    for k in range(events.ROLLOUT_PARTITIONS):
        with contextlib.suppress(nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            owners.add(json.loads((await partitions.get(f"scorer.partition.{k}")).value or b"{}")["owner"])
    return {int(owner.split("-")[-2]) for owner in owners}


async def kill_at(settings: Settings, run: str, version: int, process: subprocess.Popen[bytes]) -> set[int]:
    """SIGKILL ``process`` once ``run`` has published weights ``version``; the partition owners just before."""
    bus = await Bus.for_settings(settings, "test-killer")
    decoder: events.Decoder[events.WeightUpdate] = events.Decoder(events.WeightUpdate)
    try:
        while True:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                update = decode_message(decoder, await bus.js.get_last_msg("WEIGHTS", f"weights.{run}"))
                if update.version >= version:
                    owners = await partition_owners(bus)
                    process.send_signal(signal.SIGKILL)
                    return owners
            await asyncio.sleep(0.2)  # noqa: sleep - the polling interval of this watch
    finally:
        await bus.close()


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
                bound = (update.version + OFF_POLICY + 1) * BATCH_SIZE + update.num_unused_total
                seen.append((stored, update.version, bound))
                assert stored <= bound, f"{stored} rollouts stored at version {update.version}: bound {bound}"
            await asyncio.sleep(0.1)  # noqa: sleep - the sampling interval of this watch
    finally:
        await bus.close()
    return seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_inference_and_two_scorer_replicas_keep_the_bound_and_score_whole_groups(
        tmp_path: Path, stack: tuple[subprocess.Popen[str], Output, dict[str, int]], clean_env: dict[str, str]) -> None:
    _, output, ports = stack
    output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    data_dir = tmp_path / "data"
    env = clean_env | {"FLYWHEEL_NATS_PORT": str(ports["nats"]), "FLYWHEEL_GATEWAY_PORT": str(ports["gateway"])}
    second = subprocess.Popen([sys.executable, "-m", "flywheel_inference", "--port", str(free_port())], env=env,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "inference-2.log").open("w"), cwd=ROOT)
    # The second scorer is killed (SIGKILL) at version KILL_AT: its partitions pass to the first.
    second_scorer = subprocess.Popen([sys.executable, "-m", "flywheel_scorer"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=(tmp_path / "scorer-2.log").open("w"), cwd=ROOT)
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", "replicas", "--data-dir",
             str(data_dir), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
             "--inference-port", str(ports["inference"]), "--set", f"trainer.num_steps={NUM_STEPS}",
             "--set", "sft.steps=20"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        settings = Settings(data_dir=data_dir, nats_port=ports["nats"])

        sampling: set[int] = set()

        async def watch() -> tuple[list[tuple[int, int, int]], set[int], set[int]]:
            done = asyncio.Event()
            watcher = asyncio.ensure_future(watch_bound(settings, "replicas", done, sampling))
            killer = asyncio.ensure_future(kill_at(settings, "replicas", KILL_AT, second_scorer))
            ended = asyncio.ensure_future(asyncio.to_thread(run.wait, 420))
            await asyncio.wait([watcher, ended], return_when=asyncio.FIRST_COMPLETED)  # a broken bound ends it
            done.set()
            bus = await Bus.for_settings(settings, "test-owners")
            try:
                return await watcher, await killer, await partition_owners(bus)
            finally:
                await bus.close()

        seen, owners_before, owners_after = asyncio.run(watch())
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0, out[-4000:]
        scores = asyncio.run(group_scores(settings, "replicas"))
    finally:
        for process in (second, second_scorer):
            process.terminate()
            process.wait(timeout=30)
    assert len(seen) > 20 and seen[-1][1] >= NUM_STEPS - 1, seen[-5:]
    lines = [json.loads(line) for line in (data_dir / "runs" / "replicas" / "metrics.jsonl").read_text().splitlines()]
    assert all(line["staleness_max"] <= OFF_POLICY for line in lines if line["step"] > 0)
    assert second.pid in sampling and len(sampling) == 2, sampling  # both replicas sampled the run
    assert len(scores) >= NUM_STEPS * BATCH_SIZE and not [sc.error for sc in scores if sc.error], \
        [sc.error for sc in scores if sc.error][:3]
    assert second_scorer.pid in owners_before and len(owners_before) == 2, owners_before  # split over both scorers
    assert owners_after and second_scorer.pid not in owners_after, owners_after  # the survivor took them all
