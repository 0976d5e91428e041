"""A run owns itself: the orchestrator of the stack owns it, not the ``flywheel run`` that
started it. A dead trainer is restarted; the ``flywheel run`` process killed leaves the run
going to its end; a pause (``flywheel runs pause``) holds it until it is resumed; a stop
(Ctrl-C with ``--stop``, or ``flywheel runs stop`` from elsewhere)
ends it visibly and ``flywheel runs resume`` (or ``flywheel run --resume``) goes on where it
stopped, while ``flywheel runs follow`` prints its steps; the orchestrator killed, the stack
restarts it and the new one takes the run over once the lease ran out.

One ``flywheel up`` stack on free ports serves every run here, each a short one of the
shipped example config. The run lease is 3 s (``FLYWHEEL_RUN_LEASE_S``, in the stack's
environment too), so an owner's death is seen within seconds. Every run must end with each
step trained once: ``metrics.jsonl`` lists steps 0..N once each, and versions follow steps.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.runs import end_of, get_run
from flywheel.ops.run import STOP_TIMEOUT_S
from tests.e2e.test_up import READY_TIMEOUT_S, Output, nats_login, poll
from tests.e2e.test_up_supervisor import alive

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "reverse-text.toml"
NUM_STEPS = 8
STEP_TIMEOUT_S = 240.0  # model load, SFT warm-up and the first steps on a busy two-core machine


def start_run(run: str, data_dir: Path, ports: dict[str, int], env: dict[str, str], *extra: str) -> tuple[
        subprocess.Popen[str], Output]:
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", run, "--data-dir", str(data_dir),
            "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
            "--inference-port", str(ports["inference"]), "--set", f"trainer.num_steps={NUM_STEPS}",
            "--set", "sft.steps=20", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env | {"FLYWHEEL_RUN_LEASE_S": "3"}, cwd=ROOT)
    return proc, Output(proc)


def runs_command(command: str, run: str, data_dir: Path, ports: dict[str, int], env: dict[str, str]) -> tuple[
        subprocess.Popen[str], Output]:
    """``flywheel runs COMMAND RUN`` against the stack, running."""
    argv = [sys.executable, "-m", "flywheel.ops.cli", "runs", command, run, "--nats-port", str(ports["nats"])]
    if command == "resume":
        argv += ["--data-dir", str(data_dir), "--gateway-port", str(ports["gateway"]),
                 "--inference-port", str(ports["inference"])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env | {"FLYWHEEL_RUN_LEASE_S": "3"}, cwd=ROOT)
    return proc, Output(proc)


def flywheel(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120, check=False)


def finish(proc: subprocess.Popen[str], output: Output) -> None:
    output.wait_for(rf"^step\s+{NUM_STEPS}/{NUM_STEPS}", STEP_TIMEOUT_S)
    assert output.exit_status(proc, 60) == 0, output.text


def state(nats_url: str, run: str) -> events.RunState:
    async def read() -> events.RunState:
        bus = await Bus.connect(nats_url, "test-run-owner", ensure=False)
        try:
            found = await get_run(bus, run)
        finally:
            await bus.close()
        assert found is not None, f"run {run} is not in the runs bucket"
        return found

    return asyncio.run(read())


def publish_garbage(nats_url: str, subject: str) -> None:
    """A message that is no event, where the run's weight updates go."""
    async def publish() -> None:
        bus = await Bus.connect(nats_url, "test-run-owner", ensure=False)
        try:
            await bus.publish_raw(subject, b"\x00 not a weight update", {"Nats-Msg-Id": f"garbage-{subject}"})
        finally:
            await bus.close()

    asyncio.run(publish())


def steps_trained(data_dir: Path, run: str) -> list[tuple[int, int]]:
    lines = (data_dir / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return [(row["step"], row["version"]) for row in map(json.loads, lines)]


@pytest.fixture
def clean_env(clean_env: dict[str, str]) -> dict[str, str]:
    """Every process here, the stack's orchestrator included, with a 3 s run lease."""
    return clean_env | {"FLYWHEEL_RUN_LEASE_S": "3"}


def orchestrator_pid(owner: str | None) -> int:
    """The pid in an orchestrator's owner name (``orchestrator <host>-<pid>-<hex>``)."""
    found = re.search(r"-(\d+)-[0-9a-f]{6}$", owner or "")
    assert owner and owner.startswith("orchestrator ") and found, owner
    return int(found.group(1))


# Slow tier: about 100-150 s on two cores, the longest of the default tier; the default tier
# keeps the run's survival of every process killed (test_a_run_survives_every_process_...).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_restart_detach_stop_resume_and_takeover(stack, tmp_path: Path, clean_env: dict[str, str]) -> None:
    _, up_output, ports = stack
    up_output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    data_dir = tmp_path / "data"
    nats = nats_login(data_dir, ports["nats"])
    every_step = [(i, i) for i in range(NUM_STEPS + 1)]

    # A trainer SIGKILLed mid-run is restarted by its owner and resumes from its checkpoint;
    # garbage on the run's weights subject stops neither the owner, nor inference, nor the
    # restarted trainer (which reads that subject for the version it last published).
    proc, output = start_run("killed-trainer", data_dir, ports, clean_env)
    output.wait_for(r"^step\s+2/", STEP_TIMEOUT_S)
    trainer_pid = int(output.wait_for(r"trainer pid (\d+)", 5)[0].group(1))
    publish_garbage(nats, "weights.killed-trainer")
    os.kill(trainer_pid, signal.SIGKILL)
    output.wait_for(r"the trainer \(pid \d+\) exited with signal SIGKILL; restarting it", 30)
    finish(proc, output)
    assert steps_trained(data_dir, "killed-trainer") == every_step
    finished = state(nats, "killed-trainer")
    # The run's reward as registered, for every reader (trainer, trace store); its owner let go.
    assert finished.status == "finished" and finished.scorers == {"similarity": 1.0, "exact": 0.0}
    assert finished.owner is None and (data_dir / "runs" / "killed-trainer" / "summary.json").exists()

    # Ctrl-C on `flywheel run` detaches (the survivor test below SIGKILLs it): the run goes on to
    # its end by itself.
    proc, output = start_run("detached", data_dir, ports, clean_env)
    output.wait_for(r"^step\s+1/", STEP_TIMEOUT_S)
    proc.send_signal(signal.SIGINT)
    assert output.exit_status(proc, 30) == 0, output.text
    output.wait_for(r"^run detached: no longer following it; it goes on \(`flywheel runs follow detached`", 1)
    follower, followed = runs_command("follow", "detached", data_dir, ports, clean_env)
    assert followed.exit_status(follower, STEP_TIMEOUT_S) == 0, followed.text
    followed.wait_for(r"^run detached: finished", 1)
    followed.wait_for(r"^summary:", 1)  # as `flywheel run` ends: the run's figures, from its folder
    followed.wait_for(r"^\s+reward", 1)
    assert steps_trained(data_dir, "detached") == every_step

    # Paused from elsewhere: its owner stops the trainer (a checkpoint) and holds the run, which
    # lists as paused and makes no step; resumed, the owner starts the trainer again, and the
    # run finishes with every step trained once (`flywheel run` follows it throughout).
    held_steps = 40  # long enough that the pause lands before the end, whatever the machine's speed
    proc, output = start_run("held", data_dir, ports, clean_env, "--set", f"trainer.num_steps={held_steps}")
    output.wait_for(r"^step\s+2/", STEP_TIMEOUT_S)
    trainer_pid = int(output.wait_for(r"trainer pid (\d+)", 5)[0].group(1))
    pausing = flywheel("runs", "pause", "held", "--nats-port", str(ports["nats"]), env=clean_env)
    assert pausing.returncode == 0 and "its owner stops its trainer" in pausing.stdout, pausing.stdout + pausing.stderr
    output.wait_for(r"^run held: paused \(paused by flywheel runs pause", 10)
    poll(lambda: not alive(trainer_pid), 30, "the paused run's trainer to stop")
    held = state(nats, "held")
    assert held.status == "paused" and held.owner is not None and held.trainer_step < held_steps, held
    listed = flywheel("runs", "list", "--nats-port", str(ports["nats"]), env=clean_env)
    assert re.search(rf"^held\s+train\s+paused\s+\d+/{held_steps}", listed.stdout, re.M), listed.stdout
    resumer, resumed = runs_command("resume", "held", data_dir, ports, clean_env)
    resumed.wait_for(rf"run held: resuming at step \d+ of {held_steps} \(paused by flywheel runs pause", 60)
    for follower, followed in ((resumer, resumed), (proc, output)):
        followed.wait_for(rf"^step\s+{held_steps}/{held_steps}", STEP_TIMEOUT_S)
        assert followed.exit_status(follower, 60) == 0, followed.text
    output.wait_for(r"run held: resumed: starting the trainer again", 1)
    assert steps_trained(data_dir, "held") == [(i, i) for i in range(held_steps + 1)]

    # Ctrl-C with --stop: the trainer checkpoints, the run is marked stopped (it takes no more tasks).
    proc, output = start_run("interrupted", data_dir, ports, clean_env, "--stop")
    output.wait_for(r"^step\s+2/", STEP_TIMEOUT_S)
    proc.send_signal(signal.SIGINT)
    # Seconds as a rule; `flywheel run` itself gives up on the owner after STOP_TIMEOUT_S, saying so.
    assert output.exit_status(proc, STOP_TIMEOUT_S + 30) == 0, output.text
    stopped = state(nats, "interrupted")
    assert stopped.status == "stopped" and "stopped by flywheel-run" in (stopped.reason or ""), stopped
    assert stopped.owner is None  # its owner stopped the trainer and let go before `flywheel run` exited
    end = end_of(stopped)
    assert end is not None and end.status == "stopped"
    # Without --resume the id is refused.
    refused = subprocess.run([sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", "interrupted",
                              "--data-dir", str(data_dir), "--nats-port", str(ports["nats"]),
                              "--set", f"trainer.num_steps={NUM_STEPS}", "--set", "sft.steps=20"],
                             capture_output=True, text=True, env=clean_env, cwd=ROOT, timeout=120, check=False)
    assert refused.returncode == 1 and "add --resume" in refused.stderr, refused.stderr
    # `flywheel runs resume` goes on with it (the config it was started with), while `runs follow`
    # prints its steps from another process and exits 0 when it finished.
    proc, output = runs_command("resume", "interrupted", data_dir, ports, clean_env)
    output.wait_for(r"run interrupted: resuming at step \d+ of 8 \(run 'interrupted' stopped at", 60)
    follower, followed = runs_command("follow", "interrupted", data_dir, ports, clean_env)
    finish(proc, output)
    assert followed.exit_status(follower, 30) == 0, followed.text
    followed.wait_for(rf"^step\s+{NUM_STEPS}/{NUM_STEPS}\s", 1)
    followed.wait_for(r"^run interrupted: finished", 1)
    assert steps_trained(data_dir, "interrupted") == every_step

    # Stopped from elsewhere (`flywheel runs stop`): the follower says so and exits; the run
    # lists as stopped. A finished run, one that does not exist, one still running: not resumed.
    proc, output = start_run("stopped-elsewhere", data_dir, ports, clean_env, "--set", "trainer.num_steps=1000")
    output.wait_for(r"^step\s+2/", STEP_TIMEOUT_S)
    refused = flywheel("runs", "resume", "stopped-elsewhere", "--nats-port", str(ports["nats"]), env=clean_env)
    assert refused.returncode == 1 and "is still running" in refused.stderr, refused.stderr
    stopping = flywheel("runs", "stop", "stopped-elsewhere", "--nats-port", str(ports["nats"]), env=clean_env)
    assert stopping.returncode == 0 and "stopped by flywheel runs stop" in stopping.stdout, stopping.stdout
    assert output.exit_status(proc, 60) == 0, output.text
    output.wait_for(r"run stopped-elsewhere: stopped \(stopped by flywheel runs stop", 1)
    poll(lambda: state(nats, "stopped-elsewhere").owner is None, 30, "its owner to let go of it")
    listed = flywheel("runs", "list", "--nats-port", str(ports["nats"]), env=clean_env)
    assert listed.returncode == 0 and re.search(r"stopped-elsewhere\s+train\s+stopped\s+\d+/1000", listed.stdout), (
        listed.stdout)
    for run, why in (("killed-trainer", "finished already"), ("nope", "'nope' is not in the flywheel-runs")):
        refused = flywheel("runs", "resume", run, "--nats-port", str(ports["nats"]), "--data-dir", str(data_dir),
                           env=clean_env)
        assert refused.returncode == 1 and why in refused.stderr, refused.stderr

    # The orchestrator SIGKILLed: its trainer dies with it, the lease runs out, the run shows
    # abandoned; the stack restarts the orchestrator, which takes the run over (with
    # `flywheel run --resume` following it) and finishes it.
    proc, output = start_run("orphaned", data_dir, ports, clean_env)
    output.wait_for(r"^step\s+2/", STEP_TIMEOUT_S)
    trainer_pid = int(output.wait_for(r"trainer pid (\d+)", 5)[0].group(1))
    first_owner = state(nats, "orphaned").owner
    os.kill(orchestrator_pid(first_owner), signal.SIGKILL)
    poll(lambda: not alive(trainer_pid), 10, "the orphaned trainer to die with its orchestrator")
    proc.kill()
    proc.wait()
    poll(lambda: state(nats, "orphaned").owner not in (None, first_owner), 60,
         "a new orchestrator to take the run over")
    proc, output = start_run("orphaned", data_dir, ports, clean_env, "--resume")
    output.wait_for(r"run orphaned is (created|running) \(owner orchestrator ", 30)
    finish(proc, output)
    assert steps_trained(data_dir, "orphaned") == every_step
    assert state(nats, "orphaned").status == "finished"


def start_up(data_dir: Path, ports: dict[str, int], env: dict[str, str]) -> tuple[subprocess.Popen[str], Output]:
    up = subprocess.Popen([sys.executable, "-m", "flywheel.ops.cli", "up", "--data-dir", str(data_dir),
                           "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
                           "--inference-port", str(ports["inference"])],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return up, Output(up)


@pytest.mark.timeout(600)
@pytest.mark.long
def test_a_run_survives_every_process_and_nats_server_killed(tmp_path: Path, clean_env: dict[str, str]) -> None:
    """SIGKILL to every process at once (nats-server, each service, the trainer, `flywheel up`,
    `flywheel run`); the stack started again on the same data folder takes the run over by
    itself, and it finishes with each step trained once and no rollout trained twice."""
    from flywheel.runtime.natsserver import free_port

    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    data_dir = tmp_path / "data"
    up, up_output = start_up(data_dir, ports, clean_env)
    try:
        up_output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
        proc, output = start_run("survivor", data_dir, ports, clean_env)
        output.wait_for(r"^step\s+3/", STEP_TIMEOUT_S)
        pids = [int(m.group(1)) for m in up_output.matching(r"^started \S+ \(pid (\d+)\)")]
        pids.append(int(output.wait_for(r"trainer pid (\d+)", 5)[0].group(1)))
        # The supervisor first: killed after a service, it could start that one again (a new
        # pid holding a port) before its own turn.
        for pid in [up.pid, *pids, proc.pid]:
            os.kill(pid, signal.SIGKILL)
        up.wait()
        proc.wait()
        poll(lambda: not any(alive(pid) for pid in pids), 10, "every process of the stack to be gone")
    finally:
        if up.poll() is None:
            up.kill()
    up, up_output = start_up(data_dir, ports, clean_env)
    try:
        up_output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
        follower, followed = runs_command("follow", "survivor", data_dir, ports, clean_env)
        assert followed.exit_status(follower, STEP_TIMEOUT_S) == 0, followed.text
        followed.wait_for(r"^run survivor: finished", 1)
        assert steps_trained(data_dir, "survivor") == [(i, i) for i in range(NUM_STEPS + 1)]
        checkpoint = data_dir / "runs" / "survivor" / "checkpoint"
        trained = json.loads((checkpoint / (checkpoint / "latest").read_text() / "state.json").read_text())["trained"]
        ids = [i for step_ids in trained.values() for i in step_ids]
        assert len(ids) == len(set(ids)) == NUM_STEPS * 64, len(ids)  # every step's batch, none twice
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
