"""A teacher's signal against the trainer it feeds, and on-policy distillation against GRPO.

    python benchmarks/teacher.py --json out/teacher.json [--steps 40] [--teacher-sft-steps 600]
                                 [--teacher DIR] [--compare-grpo] [--threshold 0.45] [--set KEY=VALUE ...]

It makes the teacher as the example config says (``flywheel sft`` on the reference answers of
reverse-text, ``--teacher-sft-steps`` steps, then ``flywheel export``; or takes ``--teacher DIR``),
then runs ``examples/reverse-text-opd.toml`` through ``flywheel run`` (the embedded stack on free
ports), reading the inference heartbeats on its bus every second for the teacher's counters.

Figures:

- ``teacher_tokens_per_s``: tokens through the teacher's forward passes per second it was busy
  (its capacity), from the heartbeat counters ``num_tokens`` and ``busy_s``;
- ``trainer_tokens_per_s``: the trainer's tokens per second of step (``num_tokens / step_s``),
  the mean over the run's steps;
- ``teacher_vs_trainer``: their ratio. At 1.0 or more the teacher values a step's rollouts
  faster than the trainer trains on them, so it never holds training back (target >= 1.0);
- ``teacher_busy_fraction``: the teacher's busy seconds over the run's training seconds;
- ``opd_reward_first``, ``opd_reward_last``: the run's mean reward, first and last quarter.

With ``--compare-grpo``, the same start trained by GRPO (``examples/reverse-text.toml`` with the
OPD example's warm-up) for as many steps, and for both runs ``*_steps_to``, ``*_seconds_to``: the
first step (and seconds from the first step) where the reward's mean over the last 10 steps
reaches ``--threshold`` (null: never). Both runs are one sample each: rerun before reading much
into a difference. Not covered: several inference replicas (each would host its share).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OPD = ROOT / "examples" / "reverse-text-opd.toml"
GRPO = ROOT / "examples" / "reverse-text.toml"
WINDOW = 10


def flywheel(*argv: str, timeout_s: float = 1800) -> None:
    done = subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, check=False)
    if done.returncode:
        raise SystemExit(f"flywheel {' '.join(argv)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def make_teacher(data_dir: Path, steps: int) -> Path:
    print(f"teacher: flywheel sft on reverse-text's reference answers, {steps} steps", flush=True)
    flywheel("sft", str(GRPO), "--run-id", "teacher", "--data-dir", str(data_dir), "--set", f"sft.steps={steps}",
             "--set", f"trainer.checkpoint_every={steps}")
    out = data_dir / "teacher-model"
    flywheel("export", "teacher", str(out), "--data-dir", str(data_dir))
    return out


async def watch_teacher(data_dir: Path, nats_port: int, run: str, proc: subprocess.Popen[str],
                        found: dict[str, Any]) -> None:
    """Keep the newest counters of ``run``'s teachers from the inference heartbeats until ``proc`` ends."""
    from flywheel.contract.bus import Bus
    from flywheel.contract.service import read_heartbeats
    from flywheel.contract.settings import Settings

    logging.getLogger("flywheel.contract.bus").setLevel(logging.ERROR)  # the stack starts and stops under it
    bus: Bus | None = None
    while proc.poll() is None:
        await asyncio.sleep(1.0)
        try:
            if bus is None:
                # The stack `flywheel run` started logs its operator in with a password it made in data_dir.
                nats_url = Settings(data_dir=data_dir, nats_port=nats_port).resolved_nats_url
                bus = await asyncio.wait_for(Bus.connect(nats_url, name="teacher-benchmark", ensure=False), 10)
            for beat in await asyncio.wait_for(read_heartbeats(bus), 5):
                if beat.service == "inference":
                    found.update(beat.info.get("teachers", {}).get(run, {}))
        except Exception:  # the stack is starting or stopping: try again
            pass
    if bus is not None:
        try:
            await asyncio.wait_for(bus.nc.close(), 5)
        except Exception:  # the server is gone already
            pass


def run(config: Path, run_id: str, data_dir: Path, steps: int, *sets: str) -> tuple[list[dict[str, Any]], dict]:
    """One ``flywheel run`` on its own ports: its metrics lines (steps only) and its teachers' last counters."""
    from flywheel.runtime.natsserver import free_port

    nats_port = free_port()
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(config), "--run-id", run_id, "--data-dir",
            str(data_dir), "--nats-port", str(nats_port), "--gateway-port", str(free_port()), "--inference-port",
            str(free_port()), "--set", f"trainer.num_steps={steps}"]
    for item in sets:
        argv += ["--set", item]
    print(f"{run_id}: flywheel run {config.name}, {steps} steps", flush=True)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        teachers: dict[str, Any] = {}
        asyncio.run(watch_teacher(data_dir, nats_port, run_id, proc, teachers))
        if proc.wait():
            log.seek(0)
            raise SystemExit(f"run {run_id} failed:\n{log.read()[-4000:]}")
    lines = [json.loads(line) for line in (data_dir / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    return lines[1:], teachers


def reaches(metrics: list[dict[str, Any]], threshold: float) -> tuple[int | None, float | None]:
    """The first step whose last-``WINDOW`` mean reward reaches ``threshold``, and seconds to it from step 1."""
    start = datetime.fromisoformat(metrics[0]["time"])
    rewards = [m["reward_mean"] for m in metrics]
    for i, m in enumerate(metrics):
        window = rewards[max(0, i - WINDOW + 1):i + 1]
        if sum(window) / len(window) >= threshold:
            return m["step"], (datetime.fromisoformat(m["time"]) - start).total_seconds()
    return None, None


def quarter_means(metrics: list[dict[str, Any]]) -> tuple[float, float]:
    k = max(1, len(metrics) // 4)
    rewards = [m["reward_mean"] for m in metrics]
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the figures")
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    parser.add_argument("--teacher-sft-steps", type=int, default=600)
    parser.add_argument("--teacher", help="a teacher model folder to use instead of making one")
    parser.add_argument("--compare-grpo", action="store_true", help="also train the same start with GRPO")
    parser.add_argument("--threshold", type=float, default=0.45, help="the reward both runs race to")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run config override for both runs (repeatable), e.g. trainer.lr=3e-3")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flywheel-teacher-") as tmp:
        data_dir = Path(tmp)
        teacher = Path(args.teacher).resolve() if args.teacher else make_teacher(data_dir, args.teacher_sft_steps)
        opd, teachers = run(OPD, "opd", data_dir, args.steps, f"teachers.expert.model={teacher}", *args.set)
        counters = teachers.get("expert", {})
        if not counters.get("busy_s"):
            raise SystemExit(f"no teacher counters in the inference heartbeats: {teachers}")
        teacher_tps = counters["num_tokens"] / counters["busy_s"]
        trainer_tps = sum(m["num_tokens"] / m["step_s"] for m in opd) / len(opd)
        figures: dict[str, Any] = {
            "steps": args.steps, "teacher": str(teacher), "overrides": args.set,
            "teacher_tokens_per_s": teacher_tps, "trainer_tokens_per_s": trainer_tps,
            "teacher_vs_trainer": teacher_tps / trainer_tps,
            "teacher_busy_fraction": counters["busy_s"] / sum(m["step_s"] + m.get("wait_s", 0.0) for m in opd),
            "teacher_num_signals": counters.get("num_signals"), "teacher_num_errors": counters.get("num_errors"),
        }
        figures["opd_reward_first"], figures["opd_reward_last"] = quarter_means(opd)
        if args.compare_grpo:
            from flywheel.contract.config import RunConfig

            warmup = RunConfig.from_toml(OPD).sft.steps  # the same start: the OPD example's warm-up
            grpo, _ = run(GRPO, "grpo", data_dir, args.steps, f"sft.steps={warmup}", *args.set)
            figures["grpo_reward_first"], figures["grpo_reward_last"] = quarter_means(grpo)
            figures["threshold"] = args.threshold
            figures["opd_steps_to"], figures["opd_seconds_to"] = reaches(opd, args.threshold)
            figures["grpo_steps_to"], figures["grpo_seconds_to"] = reaches(grpo, args.threshold)
    figures["benchmark_s"] = time.perf_counter() - started
    for key, value in figures.items():
        print(f"  {key:24} {value:.3f}" if isinstance(value, float) else f"  {key:24} {value}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
