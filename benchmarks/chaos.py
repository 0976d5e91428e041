"""Chaos: one real training run while Flywheel's processes are killed and nats-server restarts.

    python benchmarks/chaos.py --json out/chaos.json [--kills 20] [--worker-kills 5] [--nats-restarts 3]
                                                     [--seed 0] [--cluster 3] [--replicas 2]
    python benchmarks/chaos.py --faults extended --json out/chaos-extended.json

Starts ``flywheel up`` (its own nats-server, gateway, orchestrator, recorder, scorer, sandbox,
inference; a temporary data folder, free ports), then ``flywheel run examples/reverse-text.toml``
against it. Once the run trains, it kills, one event at a time: ``--kills`` Flywheel
processes picked at random among the services ``flywheel up`` supervises and the run's
trainer (SIGKILL), ``--worker-kills`` environment workers picked at random among those alive
(SIGKILL: the service holding one fails its calls in flight and starts another), and restarts
nats-server ``--nats-restarts`` times (SIGTERM and SIGKILL in turn; ``flywheel up`` starts it
again), in a random order. After each event it waits for
the run to train again, then for a few more steps. Nobody acts by hand: the supervisor
restarts the services, the run's orchestrator restarts its trainer.

When the run has ended it checks, from the bus, the run folder and the trace API:

- ``finished``: ``flywheel run`` exited 0 after the last step;
- ``trained_twice``: rollout ids in more than one step of the final checkpoint;
- ``rollouts_lost``: rollouts of the run on the bus that the trainer acknowledged but
  neither trained, dropped, nor holds in its journal (acknowledged without a trace);
- ``tasks_lost``: tasks of the run that were dead-lettered, or have an incomplete group
  on the bus, or were neither rolled out nor left over when the run finished (the task
  supply publishes ahead: inference skips the tasks still queued when the run ends, and
  counts them in its heartbeat);
- ``phantom_branches``: rollouts whose trace (``GET /v1/traces/{id}``) has nodes the
  published rollout does not, or a ``final_leaf`` other than the rollout's last node;
- ``max_recovery_s``: over the events, seconds from the kill to the next trained step
  (target at most 15); ``events`` lists each one.

With ``--faults extended`` the events are instead faults no process exit makes, each once, in
a random order: a score of NaN (msgpack) and one of 1e300 (plain JSON) for a rollout of the run;
inference paused (SIGSTOP) past the run's lease (``run_lease_s`` 15 s here), then SIGCONT; the
durable consumer of the run's tasks deleted; the TASKS stream purged; a forged weight update
with huge counts (version 10**6, 10**12 rollouts dropped, naming no weights that exist); the
data folder's disk filled and freed (the data folder is a size-limited tmpfs when this machine
lets the benchmark mount one; else this event is left out, and said); and a second ``flywheel
up`` on the same data folder with other ports, which must be refused. A pause's recovery
counts from SIGCONT, a full disk's from the moment space is freed. ``needed_a_hand`` counts
the events after which the run did not train again by itself within the recovery timeout
(the target is 0, and max recovery at most 30 s).

With ``--cluster 3`` the stack runs three nats-server nodes (``flywheel up --cluster 3``, every
stream on each node) and each NATS event kills (SIGTERM and SIGKILL in turn) one node picked at
random; the stack restarts it and it catches up from the others.

With ``--replicas N`` there are N replicas of inference and of the scorer: ``flywheel up``'s one
of each, and N - 1 more each that the benchmark starts (and, killed, starts again at once, as a
supervisor would); kills pick among every replica. The inference replicas share the run's
admission bound, the scorer replicas split the rollout partitions (a killed one's pass on once
its leases lapse).

Figures move from run to run on a shared machine; the keys that must be 0 must be 0 every
time. Not covered: killing ``flywheel up`` or the orchestrator (the supervisors: an
orchestrator's death leaves the run to the next one once its lease ran out, 60 s here;
``tests/e2e/test_run_owner.py`` covers it with a 3 s lease), replicas of the gateway, recorder
and sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from flywheel.contract import events
from flywheel.contract.config import RunConfig
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import free_port, port_open

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "reverse-text.toml"
RUN = "chaos"
SERVICES = ("gateway", "recorder", "scorer", "sandbox", "inference", "trainer")
STEPS_BETWEEN_EVENTS = 6
RECOVERY_TIMEOUT_S = 180.0
EXTENDED = ("nan-score", "huge-score", "pause", "consumer", "purge", "forged-update", "disk", "second-up")
LEASE_S = 15.0  # the run lease of an extended run: a pause of PAUSE_S outlives it
PAUSE_S = 25.0
DISK_MIB = 4096  # the size-limited data folder of an extended run
DISK_FULL_S = 15.0  # how long the disk stays full


class Lines:
    """A process's output lines, read by a thread, each with the time it arrived."""

    def __init__(self, proc: subprocess.Popen[str], echo: str | None) -> None:
        self.lines: list[tuple[float, str]] = []
        self.ended = threading.Event()
        self._new = queue.Queue[None]()
        self.echo = echo
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if self.echo is not None:
                print(f"[{self.echo}] {line.rstrip()}", flush=True)
            self._new.put(None)
        self.ended.set()
        self._new.put(None)

    def matching(self, pattern: str, since: float = 0.0) -> list[tuple[float, re.Match[str]]]:
        return [(t, m) for t, line in list(self.lines) if t >= since and (m := re.search(pattern, line))]

    def wait_for(self, pattern: str, timeout_s: float, since: float = 0.0) -> tuple[float, re.Match[str]]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.matching(pattern, since)
            if found:
                return found[0]
            if self.ended.is_set():
                raise RuntimeError(f"the process ended before printing {pattern!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no line like {pattern!r} within {timeout_s:g}s")
            try:
                self._new.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def latest_pids(up: Lines, run: Lines) -> dict[str, int]:
    """The current pid of every process ``flywheel up`` started, and of the run's trainer."""
    pids = {m.group(1): int(m.group(2)) for _, m in up.matching(r"^started (\S+) \(pid (\d+)\)")}
    trainers = run.matching(r"trainer pid (\d+)")
    if trainers:
        pids["trainer"] = int(trainers[-1][1].group(1))
    return {name: pid for name, pid in pids.items() if alive(pid)}


def parent_of(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def worker_pids(services: dict[str, int]) -> dict[str, int]:
    """The environment workers alive now, as ``worker-<n> of <service>``: every process running
    :func:`flywheel.runtime.envworker.main` (the Python inside its bubblewrap sandbox), named by
    the service whose process tree holds it."""
    owners = {pid: name for name, pid in services.items()}
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"bwrap") or not any(b"flywheel.runtime.envworker import main" in a for a in argv):
            continue
        pid, ancestor = int(entry.name), int(entry.name)
        while ancestor > 1 and ancestor not in owners:
            ancestor = parent_of(ancestor)
        found[f"worker-{pid} of {owners.get(ancestor, 'another process')}"] = pid
    return found


def last_step(run: Lines) -> int:
    found = run.matching(r"^step\s+(\d+)/")
    return int(found[-1][1].group(1)) if found else 0


def wait_steps(run: Lines, after: float, num: int, timeout_s: float) -> float:
    """Wait until ``num`` steps are printed after time ``after``; the time of the first one."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = run.matching(r"^step\s+(\d+)/", since=after)
        if len(found) >= num:
            return found[0][0]
        if run.ended.is_set():
            raise RuntimeError("the run ended while the benchmark waited for steps")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{num} trained steps did not come within {timeout_s:g}s of the event")
        time.sleep(0.2)


async def collect(nats_url: str, gateway_url: str, data_dir: Path, num_left_over: int) -> dict[str, Any]:
    """The run's books, after it ended: what the bus holds, what the trainer kept, what the trace API shows."""
    import httpx
    import msgspec
    import nats.errors

    from flywheel.contract.bus import Bus, decode_events

    bus = await Bus.connect(nats_url, "chaos-check", ensure=False)
    decoder = events.Decoder(events.Rollout)
    try:
        rollouts: dict[str, events.Rollout] = {}
        sub = await bus.js.subscribe(f"rollouts.{RUN}.>", ordered_consumer=True)
        while True:
            try:
                msg = await sub.next_msg(timeout=3.0)
            except nats.errors.TimeoutError:
                break
            for r in decode_events(decoder, msg):  # a group's rollouts travel as one batch message
                rollouts.setdefault(r.id, r)
        await sub.unsubscribe()
        tasks: dict[str, int] = {}
        sub = await bus.js.subscribe(f"tasks.{RUN}.>", ordered_consumer=True, headers_only=True)
        while True:
            try:
                msg = await sub.next_msg(timeout=3.0)
            except nats.errors.TimeoutError:
                break
            assert msg.headers is not None  # every task is published with its Nats-Msg-Id
            tasks.setdefault(msg.headers["Nats-Msg-Id"], msg.metadata.sequence.stream)
        await sub.unsubscribe()
        dead_tasks: set[str] = set()
        sub = await bus.js.subscribe("dead.>", ordered_consumer=True)
        letters = events.Decoder(events.DeadLetter)
        reasons: Counter[str] = Counter()
        while True:
            try:
                msg = await sub.next_msg(timeout=2.0)
            except nats.errors.TimeoutError:
                break
            letter = letters.decode(msg.data)
            reasons[f"{letter.stream} via {letter.consumer}: {letter.reason[:120]}"] += 1
            if letter.stream == "TASKS" and letter.original_subject.startswith(f"tasks.{RUN}."):
                try:
                    dead_tasks.add(events.Decoder(events.Task).decode(letter.payload).id)
                except msgspec.DecodeError:
                    dead_tasks.add(f"seq-{letter.stream_seq}")
        await sub.unsubscribe()
        durable = await bus.js.consumer_info("ROLLOUTS", f"trainer-{RUN}-rollouts")
    finally:
        await bus.close()

    folder = data_dir / "runs" / RUN / "checkpoint"
    state = json.loads((folder / (folder / "latest").read_text().strip() / "state.json").read_text())
    trained = Counter(i for ids in state["trained"].values() for i in ids)
    journal = folder / "journal.jsonl"
    buffered = ({json.loads(line)["id"] for line in journal.read_text().splitlines() if line} if journal.exists()
                else set())
    kept = set(trained) | set(state["dropped"]) | buffered
    unreceived = (durable.num_pending or 0) + (durable.num_ack_pending or 0)
    rollouts_lost = max(0, len(set(rollouts) - kept) - unreceived)

    groups: dict[str, list[events.Rollout]] = {}
    for r in rollouts.values():
        groups.setdefault(r.task_id, []).append(r)
    partial = {task for task, members in groups.items() if len(members) < members[0].group_size}
    not_rolled_out = len(set(tasks) - set(groups))
    tasks_lost = len(dead_tasks) + len(partial) + max(0, not_rolled_out - num_left_over)

    phantom = 0
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30.0) as http:
        deadline = time.monotonic() + 120
        while True:  # the recorder catches up with what the kills held back
            detail = (await http.get(f"/v1/runs/{RUN}")).json()
            if detail.get("num_rollouts", 0) >= len(rollouts) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        semaphore = asyncio.Semaphore(16)

        async def check(r: events.Rollout) -> bool:
            async with semaphore:
                trace = (await http.get(f"/v1/traces/{r.id}")).json()
            node_ids = {n["id"] for n in trace.get("nodes", [])}
            return node_ids != {n.id for n in r.nodes} or trace.get("final_leaf") != r.nodes[-1].id

        phantom = sum(await asyncio.gather(*(check(r) for r in rollouts.values() if r.nodes)))
    return {
        "trained_twice": sum(1 for n in trained.values() if n > 1),
        "rollouts_lost": rollouts_lost,
        "tasks_lost": tasks_lost,
        "phantom_branches": phantom,
        "num_rollouts_on_bus": len(rollouts),
        "num_tasks_on_bus": len(tasks),
        "num_trained": len(trained),
        "num_dropped": len(state["dropped"]),
        "num_tasks_dead_lettered": len(dead_tasks),
        "num_tasks_left_over": num_left_over,
        "dead_letters": dict(reasons.most_common(10)),
    }


async def inject(kind: str, nats_url: str) -> str:
    """One fault made on the bus (the stack's operator login); what was done, for the log."""
    import nats.js.errors
    from nats.js.api import DeliverPolicy

    from flywheel.contract.bus import Bus, decode_events
    from flywheel.contract.runs import get_run, task_durable

    bus = await Bus.connect(nats_url, "chaos-faults", ensure=False)
    try:
        if kind in ("nan-score", "huge-score"):
            sub = await bus.js.subscribe(f"rollouts.{RUN}.>", ordered_consumer=True, deliver_policy=DeliverPolicy.LAST)
            rollout = decode_events(events.Decoder(events.Rollout), await sub.next_msg(timeout=10))[-1]
            await sub.unsubscribe()
            state = await get_run(bus, RUN)
            scorer = next(iter(state.scorers)) if state is not None and state.scorers else "reward"
            value, content_type = (float("nan"), events.MSGPACK) if kind == "nan-score" else (1e300, events.JSON)
            score = events.Score(run=RUN, env=rollout.env, rollout_id=rollout.id, group_id=rollout.group_id,
                                 scorer=scorer, value=value)
            await bus.js.publish(score.subject(), events.encode(score, content_type),
                                 headers={"Nats-Msg-Id": score.msg_id, "Content-Type": content_type})
            return f"score {value!r} ({content_type}) from {scorer} for rollout {rollout.id}"
        if kind == "consumer":
            await bus.js.delete_consumer("TASKS", task_durable(RUN))
            return f"deleted consumer {task_durable(RUN)} of TASKS"
        if kind == "purge":
            await bus.js.purge_stream("TASKS")
            return "purged TASKS"
        if kind == "forged-update":
            forged = events.WeightUpdate(run=RUN, version=10**6, uri="file:///nonexistent/forged.safetensors",
                                         sha256="0" * 64, size_bytes=1, trainer_step=10**6,
                                         num_dropped_total=10**12)
            await bus.js.publish(forged.subject(), events.encode(forged), headers={"Nats-Msg-Id": forged.msg_id})
            return "forged weight update: version 10**6, 10**12 dropped"
        raise ValueError(kind)
    except nats.js.errors.NotFoundError as exc:
        return f"{kind}: nothing to act on ({exc})"
    finally:
        await bus.close()


def mount_small_disk(folder: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` at ``folder``; None when done, else why not."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(folder)],
                          check=False, capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def fill_disk(path: Path) -> int:
    """Write ``path`` until its file system is full; MiB written."""
    written = 0
    with path.open("wb") as out:
        chunk = b"\0" * 2**20
        try:
            while True:
                out.write(chunk)
                out.flush()
                written += 1
        except OSError:
            pass
    return written


def second_up(flywheel: list[str], data_dir: Path, env: dict[str, str]) -> str:
    """A second ``flywheel up`` on the data folder, other ports: refused, naming the first."""
    argv = [*flywheel, "up", "--data-dir", str(data_dir), "--nats-port", str(free_port()), "--gateway-port",
            str(free_port()), "--inference-port", str(free_port())]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError("a second flywheel up on the same data folder was not refused within 60s") from exc
    said = (done.stdout + done.stderr).strip()
    if done.returncode == 0 or "in use by another stack" not in said:
        raise RuntimeError(f"a second flywheel up on the same data folder was not refused (exit {done.returncode}): "
                           f"{said[-400:]}")
    return f"second flywheel up refused (exit {done.returncode}): {said.splitlines()[-1][:160]}"


async def leftover_tasks(nats_url: str, group_size: int, settle_s: float = 60.0) -> int:
    """Tasks of the run left over when it ended: those inference skipped (its heartbeat counts
    their rollouts) and those still queued, once the inference consumer has settled."""
    import nats.js.errors

    from flywheel.contract.bus import Bus
    from flywheel.contract.service import read_heartbeats

    bus = await Bus.connect(nats_url, "chaos-leftover", ensure=False)
    try:
        deadline = time.monotonic() + settle_s
        while True:
            try:  # the run's task consumer; inference deletes it once a finished run's tasks are done with
                info = await bus.js.consumer_info("TASKS", f"inference-{RUN}")
                queued = (info.num_pending or 0) + (info.num_ack_pending or 0)
            except nats.js.errors.NotFoundError:
                queued = 0
            if queued == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        await asyncio.sleep(6.0)  # one more heartbeat of inference, with its final counters
        skipped = sum(int(b.info.get("runs", {}).get(RUN, {}).get("num_skipped", 0))
                      for b in await read_heartbeats(bus) if b.service == "inference")
        return queued + skipped // group_size
    finally:
        await bus.close()


def recover(run: Lines, at: float, target: str, how: str, event_log: list[dict[str, Any]],
            result: dict[str, Any]) -> bool:
    """Wait for the run to train again after an event at ``at`` (then a few more steps); logged.
    False when it did not within RECOVERY_TIMEOUT_S: it needed a hand."""
    try:
        recovered = wait_steps(run, at, 1, RECOVERY_TIMEOUT_S)
    except TimeoutError:
        event_log.append({"target": target, "signal": how, "recovery_s": None})
        result["needed_a_hand"] += 1
        return False
    event_log.append({"target": target, "signal": how, "at_step": last_step(run),
                      "recovery_s": round(recovered - at, 2)})
    print(f"chaos: {how} {target}: trained again after {recovered - at:.1f}s", flush=True)
    wait_steps(run, at, STEPS_BETWEEN_EVENTS, RECOVERY_TIMEOUT_S)
    return True


def extended_fault(kind: str, pids: dict[str, int], nats_url: str, data_dir: Path, flywheel: list[str],
                   env: dict[str, str]) -> tuple[float, str]:
    """Make one extended fault; when its recovery starts counting (a pause: at SIGCONT; a full
    disk: once freed), and what was done."""
    if kind == "pause":
        os.kill(pids["inference"], signal.SIGSTOP)
        time.sleep(PAUSE_S)  # noqa: sleep - the pause itself: inference stopped past the run's lease
        os.kill(pids["inference"], signal.SIGCONT)
        return time.monotonic(), f"inference (pid {pids['inference']}) paused {PAUSE_S:g}s, lease {LEASE_S:g}s"
    if kind == "disk":
        filler = data_dir / "chaos-filler"
        mib = fill_disk(filler)
        time.sleep(DISK_FULL_S)  # noqa: sleep - the disk stays full this long
        filler.unlink()
        return time.monotonic(), f"data folder's disk filled ({mib} MiB) for {DISK_FULL_S:g}s, then freed"
    if kind == "second-up":
        at = time.monotonic()
        return at, second_up(flywheel, data_dir, env)
    at = time.monotonic()
    return at, asyncio.run(inject(kind, nats_url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--kills", type=int, default=20, help="Flywheel processes to SIGKILL")
    parser.add_argument("--worker-kills", type=int, default=5,
                        help="environment workers to SIGKILL (the services that hold them start new ones)")
    parser.add_argument("--nats-restarts", type=int, default=3, help="nats-server restarts (SIGTERM, SIGKILL, ...)")
    parser.add_argument("--steps", type=int, help="trainer.num_steps of the run (300; 120 with --faults extended)")
    parser.add_argument("--faults", choices=("kills", "extended"), default="kills",
                        help="kills: processes killed, nats-server restarted; extended: the faults no exit makes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cluster", type=int, default=1, help="nats-server nodes (3: a JetStream cluster)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of inference and of the scorer")
    parser.add_argument("--verbose", action="store_true", help="echo the stack's and the run's output")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    group_size = RunConfig.from_toml(CONFIG).group_size
    extended = args.faults == "extended"
    steps = args.steps or (120 if extended else 300)
    plan = (list(EXTENDED) if extended else
            ["kill"] * args.kills + ["worker"] * args.worker_kills + ["nats"] * args.nats_restarts)
    rng.shuffle(plan)

    data_dir = Path(tempfile.mkdtemp(prefix="flywheel-chaos-"))
    small_disk = extended and mount_small_disk(data_dir, DISK_MIB) is None
    if extended and not small_disk:
        print(f"chaos: cannot mount a size-limited data folder here ({mount_small_disk(data_dir, DISK_MIB)}): the "
              "disk event is left out", flush=True)
        plan.remove("disk")
    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    while any(port_open("127.0.0.1", ports["nats"] + i) for i in range(1, args.cluster)):  # a node a port
        ports["nats"] = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") or k == "FLYWHEEL_NATS_SERVER_BIN"}
    if extended:
        env["FLYWHEEL_RUN_LEASE_S"] = str(LEASE_S)
    common = ["--data-dir", str(data_dir), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
              "--inference-port", str(ports["inference"]), "--nats-cluster", str(args.cluster)]
    flywheel = [sys.executable, "-m", "flywheel.ops.cli"]
    up_proc = subprocess.Popen([*flywheel, "up", *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=ROOT)
    up = Lines(up_proc, "up" if args.verbose else None)
    run_proc: subprocess.Popen[str] | None = None
    result: dict[str, Any] = {"faults": args.faults, "kills": 0, "worker_kills": 0, "nats_restarts": 0,
                              "finished": False, "needed_a_hand": 0, "nats_nodes": args.cluster,
                              "replicas": args.replicas}
    nats_url = ""  # the stack's operator, once it made its logins
    extra: dict[str, subprocess.Popen[bytes]] = {}  # "inference-2", "scorer-2", ...: the replicas beyond up's
    extra_env = env | {"FLYWHEEL_DATA_DIR": str(data_dir), "FLYWHEEL_NATS_PORT": str(ports["nats"]),
                       "FLYWHEEL_NATS_CLUSTER": str(args.cluster)}

    def start_extra(name: str) -> None:
        service = name.rsplit("-", 1)[0]
        argv = [sys.executable, "-m", f"flywheel_{service}"]
        if service == "inference":
            argv += ["--port", str(free_port())]
        with (data_dir / f"{name}.log").open("a") as log:
            extra[name] = subprocess.Popen(argv, env=extra_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    event_log: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        up.wait_for(r"^Flywheel is up", 180)
        nats_url = Settings(data_dir=data_dir, nats_port=ports["nats"], nats_cluster=args.cluster).resolved_nats_url
        for i in range(2, args.replicas + 1):
            for service in ("inference", "scorer"):
                start_extra(f"{service}-{i}")
        run_proc = subprocess.Popen([*flywheel, "run", str(CONFIG), "--run-id", RUN, *common,
                                     "--set", f"trainer.num_steps={steps}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        run = Lines(run_proc, "run" if args.verbose else None)
        run.wait_for(r"^step\s+2/", 300)
        nats_signals = [signal.SIGTERM, signal.SIGKILL]
        for planned in plan:
            kind = planned
            if last_step(run) >= steps - STEPS_BETWEEN_EVENTS:
                print(f"chaos: the run is at its last steps; {len(plan) - len(event_log)} events not done",
                      flush=True)
                break
            pids = latest_pids(up, run) | {name: proc.pid for name, proc in extra.items() if proc.poll() is None}
            if kind in EXTENDED:
                at, what = extended_fault(kind, pids, nats_url, data_dir, [*flywheel], env)
                result.setdefault("extended", {})[kind] = what
                print(f"chaos: {what}", flush=True)
                if not recover(run, at, kind, "-", event_log, result):
                    raise TimeoutError(f"the run did not train again within {RECOVERY_TIMEOUT_S:g}s of {kind}")
                continue
            if kind == "nats":
                target = "nats-server" if args.cluster == 1 else f"nats-server-n{rng.randint(1, args.cluster)}"
                sig = nats_signals[result["nats_restarts"] % 2]
            elif kind == "worker":
                workers = worker_pids(pids)
                if not workers:
                    print("chaos: no environment worker alive to kill; a service kill instead", flush=True)
                    kind = "kill"
                else:
                    target, sig = rng.choice(sorted(workers)), signal.SIGKILL
                    pids[target] = workers[target]
            if kind == "kill":
                target, sig = rng.choice([s for s in (*SERVICES, *extra) if s in pids]), signal.SIGKILL
            at = time.monotonic()
            os.kill(pids[target], sig)
            if target in extra:  # the benchmark supervises the replicas it started: one starts again at once
                extra[target].wait()
                start_extra(target)
            result[{"nats": "nats_restarts", "worker": "worker_kills", "kill": "kills"}[kind]] += 1
            if not recover(run, at, target, sig.name, event_log, result):
                raise TimeoutError(f"the run did not train again within {RECOVERY_TIMEOUT_S:g}s of the event")
        run.wait_for(rf"^step\s+{steps}/{steps}", 1800)
        result["finished"] = run_proc.wait(120) == 0
        leftover = asyncio.run(leftover_tasks(nats_url, group_size))
        result.update(asyncio.run(collect(nats_url, f"http://127.0.0.1:{ports['gateway']}", data_dir, leftover)))
    finally:
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        recoveries = [e["recovery_s"] for e in event_log if e["recovery_s"] is not None]
        result["max_recovery_s"] = max(recoveries) if recoveries else None
        result["median_recovery_s"] = sorted(recoveries)[len(recoveries) // 2] if recoveries else None
        result["events"] = event_log
        result["data_dir"] = str(data_dir)
        stopping: list[subprocess.Popen[Any] | None] = [run_proc, *extra.values(), up_proc]
        for proc in stopping:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        print(json.dumps({k: v for k, v in result.items() if k != "events"}, indent=2))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        if small_disk:  # its logs are kept beside it, the tmpfs goes
            kept = data_dir.with_name(data_dir.name + "-logs")
            shutil.copytree(data_dir / "logs", kept, dirs_exist_ok=True)
            for log in (data_dir / "runs").glob("*/*.log"):
                shutil.copy2(log, kept / f"{log.parent.name}-{log.name}")
            subprocess.run(["umount", "-l", str(data_dir)], check=False)
            print(f"chaos: the data folder was a tmpfs, unmounted; its logs are in {kept}", flush=True)


if __name__ == "__main__":
    main()
