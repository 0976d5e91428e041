"""Fairness: one tenant's run paused (or flooding tasks) while another tenant's run trains.

    python benchmarks/fairness.py --json out/fairness.json [--window-s 60] [--modes pause,flood]
                                                          [--flood 20000] [--verbose]

Starts ``flywheel up`` (its own nats-server and every service, one inference process; a
temporary data folder, free ports), then two runs of ``examples/reverse-text.toml`` on it, as
two tenants: ``hog`` (tenant ``mallory``) first, so that its whole task supply is queued on the
bus ahead of the other's, then ``victim`` (tenant ``alice``). Once both train, it measures the
victim's seconds per step over ``--window-s`` (``before``), then for each mode in turn over as
long while the hog:

- ``pause``: is paused (``flywheel runs pause``: its trainer stops, so its admission stays
  full and its queued tasks wait), then resumed;
- ``flood``: has ``--flood`` more tasks published to it on the bus, a tenth of them every
  tenth of the window (its own supply goes on: it trains all along).

Figures: ``victim_step_s_before`` and, per mode, ``victim_step_s_<mode>`` (mean wall seconds
per step of the victim: the span from its first to its last step in the window over the steps
between; null when it made fewer than two: it stalled) and ``victim_step_s_ratio_<mode>``
(over ``before``); ``victim_step_s_ratio`` is the largest of those (target at most 1.5; null
when the victim stalled). Also the steps each run made per window and what inference's
heartbeat said of the hog at the end of each mode (its rollouts in flight and waiting).
Figures move from run to run on a shared machine (two runs and their trainers share its
cores): compare ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from flywheel.contract import events
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "reverse-text.toml"
HOG, VICTIM = "hog", "victim"
TENANTS = {HOG: "mallory", VICTIM: "alice"}
STEP = re.compile(r"^step\s+(\d+)/")
START_TIMEOUT_S = 600.0


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

    def steps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """When each step line came, within [start, end)."""
        return [t for t, line in list(self.lines) if start <= t < end and STEP.search(line)]

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(re.search(pattern, line) for _, line in list(self.lines)):
            if self.ended.is_set():
                raise RuntimeError(f"the process ended before printing {pattern!r}:\n"
                                   + "\n".join(line for _, line in self.lines[-30:]))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no line like {pattern!r} within {timeout_s:g}s")
            try:
                self._new.get(timeout=1.0)
            except queue.Empty:
                pass


def step_s(times: list[float]) -> float | None:
    """Mean seconds per step from the times of consecutive steps; None below two (it stalled)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else None


def ratio(during: float | None, before: float | None) -> float | None:
    return round(during / before, 3) if during is not None and before else None


async def on_bus(nats_url: str, action: str, flood: int = 0, window_s: float = 0.0) -> dict[str, Any]:
    """Pause or resume the hog, flood it with tasks over ``window_s``, or read what inference says of it."""
    from flywheel.contract.bus import Bus
    from flywheel.contract.runs import pause_run, resume_run
    from flywheel.contract.service import read_heartbeats

    bus = await Bus.connect(nats_url, "fairness", ensure=False)
    try:
        if action == "pause":
            await pause_run(bus, HOG, by="the fairness benchmark")
        elif action == "resume":
            await resume_run(bus, HOG)
        elif action == "flood":
            per_tick = -(-flood // 10)
            for tick in range(10):
                tasks = [events.Task(id=f"flood-{tick}-{i}", run=HOG, env="reverse_text",
                                     data={"text": f"flood{(tick * per_tick + i) % 997}"}, num_rollouts=8)
                         for i in range(per_tick)]
                await bus.publish_many(tasks)
                await asyncio.sleep(window_s / 10)
        elif action == "hog":
            for beat in await read_heartbeats(bus):
                if beat.service == "inference" and HOG in beat.info.get("runs", {}):
                    found = beat.info["runs"][HOG]
                    return {k: found.get(k) for k in ("num_in_flight", "num_waiting", "num_issued", "max_issued",
                                                      "tenant", "tenant_in_flight")}
        return {}
    finally:
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--window-s", type=float, default=60.0, help="seconds measured before and in each mode")
    parser.add_argument("--modes", default="pause,flood", help="what the hog does, in turn: pause, flood")
    parser.add_argument("--flood", type=int, default=20000, help="tasks the flood publishes to the hog")
    parser.add_argument("--steps", type=int, default=2000, help="trainer.num_steps of each run (more than the "
                        "benchmark lasts: each run's supply publishes its tasks for them at once)")
    parser.add_argument("--verbose", action="store_true", help="echo the stack's and the runs' output")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"pause", "flood"}:
        parser.error(f"--modes {args.modes!r}: a comma-separated list of pause, flood")

    data_dir = Path(tempfile.mkdtemp(prefix="flywheel-fairness-"))
    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") or k == "FLYWHEEL_NATS_SERVER_BIN"}
    common = ["--data-dir", str(data_dir), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
              "--inference-port", str(ports["inference"])]
    flywheel = [sys.executable, "-m", "flywheel.ops.cli"]
    procs: list[subprocess.Popen[str]] = []
    result: dict[str, Any] = {"window_s": args.window_s, "modes": modes, "flood": args.flood}
    started = time.monotonic()
    try:
        up_proc = subprocess.Popen([*flywheel, "up", *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=env, cwd=ROOT)
        procs.append(up_proc)
        Lines(up_proc, "up" if args.verbose else None).wait_for(r"^Flywheel is up", 180)
        nats_url = Settings(data_dir=data_dir, nats_port=ports["nats"]).resolved_nats_url  # the stack's operator
        runs: dict[str, Lines] = {}
        for run in (HOG, VICTIM):  # the hog's supply first: ahead of the victim's on the bus
            proc = subprocess.Popen([*flywheel, "run", str(CONFIG), "--run-id", run, *common,
                                     "--set", f"tenant={TENANTS[run]}", "--set", f"trainer.num_steps={args.steps}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
            procs.append(proc)
            runs[run] = Lines(proc, run if args.verbose else None)
            runs[run].wait_for(r"published \d+ tasks", START_TIMEOUT_S)
        for run in (HOG, VICTIM):
            runs[run].wait_for(r"^step\s+3/", START_TIMEOUT_S)
        result["startup_s"] = round(time.monotonic() - started, 1)

        def window(name: str) -> float | None:
            at = time.monotonic()
            if name == "flood":
                asyncio.run(on_bus(nats_url, "flood", args.flood, args.window_s))
            elif name == "pause":
                asyncio.run(on_bus(nats_url, "pause"))
            time.sleep(max(0.0, at + args.window_s - time.monotonic()))  # noqa: sleep - the measured window
            end = time.monotonic()
            victim, hog = runs[VICTIM].steps(at, end), runs[HOG].steps(at, end)
            result[f"victim_steps_{name}"], result[f"hog_steps_{name}"] = len(victim), len(hog)
            result[f"victim_step_s_{name}"] = None if step_s(victim) is None else round(step_s(victim) or 0.0, 3)
            if name != "before":
                result[f"hog_inference_{name}"] = asyncio.run(on_bus(nats_url, "hog"))
            if name == "pause":  # resumed; the next window starts once its trainer is back
                asyncio.run(on_bus(nats_url, "resume"))
                resumed = time.monotonic()
                while not runs[HOG].steps(resumed) and time.monotonic() < resumed + START_TIMEOUT_S:
                    time.sleep(0.5)  # noqa: sleep - polling the hog's output for its next step
            print(f"fairness: {name}: victim {len(victim)} steps ({result[f'victim_step_s_{name}']} s/step), "
                  f"hog {len(hog)} steps", flush=True)
            return step_s(victim)

        before = window("before")
        ratios = []
        for mode in modes:
            result[f"victim_step_s_ratio_{mode}"] = ratio(window(mode), before)
            ratios.append(result[f"victim_step_s_ratio_{mode}"])
        result["victim_step_s_ratio"] = None if None in ratios else max(ratios)
    finally:
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        result["data_dir"] = str(data_dir)
        for proc in reversed(procs):  # the runs first (each stops its run: it owns no stack), then the stack
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
