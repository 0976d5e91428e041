"""Flywheel against a synchronous single-process trainer (TRL's GRPOTrainer), side by side.

    scripts/setup-trl.sh                       # once: TRL in its own venv (.venv-trl)
    python benchmarks/vs_trl.py --json out/vs_trl.json [--seeds 0,1,2] [--steps 120] [--sync] [--verbose]
    python benchmarks/vs_trl.py --json out/ab.json --baseline main --workloads plain --seeds 0,1
    python benchmarks/vs_trl.py --json out/vs_trl_smollm2.json --model smollm2 --env chain_sum --seeds 0

Same machine, same SFT-warmed tiny model, same tasks (reverse-text), same reward, same
algorithm as far as TRL allows (group-mean advantages without std scaling, clipped
importance ratio, loss over the tokens of the whole batch, no KL; see
``benchmarks/trl_grpo.py``): 8 prompts x 16 samples per step, 16 new tokens, lr 5e-4, one
torch thread per process. Each run is one command as a user types it, measured from its
launch:

- TRL: ``.venv-trl/bin/python benchmarks/trl_grpo.py`` (one process);
- Flywheel: ``flywheel run CONFIG`` with no stack running, so it starts the embedded one
  (nats-server, gateway, recorder, scorer, sandbox, inference) and the run's trainer;
  asynchronous (``trainer.max_off_policy_steps = 1``, as shipped), and with ``--sync``
  also synchronous (``0``).

``--model smollm2 --env TASK`` compares on a real model and a reasoning-gym task instead:
SmolLM2-135M-Instruct after a short SFT warm-up on the task's reference answers (Flywheel's
``sft_warmup``), the task's items from the same generator and seeds on both sides
(``flywheel/reasoning-tasks`` on Flywheel; ``benchmarks/trl_grpo.py --reward reasoning-gym``
on TRL, which regenerates each item and scores it with the task's own ``score_answer``), the
settings of ``examples/smollm2-chain-sum.toml`` (4 prompts x 8 samples per step, 16 new
tokens, lr 1e-5, ``--task-config`` the task's settings; Flywheel packs its rows, as the
example does): ``PRESETS`` holds each model's defaults, any flag overrides them. Only the
``plain`` workload (the latency workload is reverse-text's).

Two workloads: ``plain`` (the reward is instant) and ``latency`` (each reward waits a
lognormal time, median 50 ms, capped at 1 s, as a remote judge or a sandbox would:
``benchmarks/envs/slow_reverse_text.py`` on Flywheel's scorer, an async reward function
on TRL, which awaits a step's 128 waits together). Several seeds, interleaved: for each
seed the systems run one after another, their order alternating, so a change in the
machine's load lands on both.

The warm-up (100 SFT steps on reverse-text's reference answers, Flywheel's own
``sft_warmup``) runs once, in this process; both systems start from the folder it writes.

Figures per run (``runs`` in the JSON, every run, never only the best):

- ``startup_s``: from the command's launch to the end of the first training step (TRL: its
  first step's line; Flywheel: the first step's weights published);
- ``step_s``: mean wall seconds per step after the first;
- ``cpu_s_per_step``: CPU seconds (user + system) of the whole process tree per step after
  the first (Flywheel: every process of the stack and the trainer; TRL: its process);
- ``steps_to_threshold``, ``time_to_threshold_s``: the first step at which the rolling
  mean reward (``--window`` steps) reaches ``--threshold``, and the wall seconds from the
  end of the first step to it (null when never reached);
- ``rewards``: the reward of every step; ``step_end_s``: when each step ended (seconds since
  the launch), so a threshold can be read again from the JSON;
- ``trained_tokens_per_s``: completion tokens trained per wall second after the first step
  (Flywheel: the loss tokens of its steps; TRL: its completions' mean length times their number);
- Flywheel only: ``cpu_s_per_step_by_process`` (the same CPU seconds, by process:
  ``inference``, ``trainer``, ``gateway``, ``recorder``, ``scorer``, ``sandbox``,
  ``nats-server``, ``fork-server``, ``workers``, ``run``), ``num_dropped_stale``, ``staleness_mean``.

Ratios (Flywheel asynchronous over TRL, means over seeds; targets in brackets):
``cpu_s_per_step_ratio`` (plain; at most 1.0), ``time_to_threshold_ratio_plain`` (at most
0.5), ``time_to_threshold_ratio_latency`` (at most 0.4), ``startup_s_ratio`` (plain; at most
1.5), and ``step_s_ratio_plain``, ``step_s_ratio_latency``; with ``--sync`` the same with a
``sync_`` prefix. A ratio over runs where the threshold was never reached is null. With
``--env TASK``, ``time_to_threshold_ratio`` is ``time_to_threshold_ratio_plain`` (the only
workload). ``trained_tokens_per_s`` (means by system) is in ``means``.

``--baseline REV`` also runs Flywheel as it is at git revision ``REV`` (its files, from ``git
archive``, imported ahead of the installed tree: the same venv and dependencies), in turn with
the others on the same warm-up, so two versions of Flywheel are compared within one hour's
load: ``baseline_cpu_s_per_step_ratio``, ``baseline_startup_s_ratio`` and
``baseline_step_s_ratio_plain`` are this tree over that revision (asynchronous, plain), and
each run's ``cpu_s_per_step_by_process`` shows where a change went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / "benchmarks" / "envs"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TRL_SCRIPT = ROOT / "benchmarks" / "trl_grpo.py"
ENV_OF = {"plain": "reverse_text", "latency": "slow_reverse_text"}
TARGETS = {"cpu_s_per_step_ratio": 1.0, "time_to_threshold_ratio_plain": 0.5,
           "time_to_threshold_ratio_latency": 0.4, "startup_s_ratio": 1.5}
# Each model's defaults (a flag overrides any): tiny from the reverse-text comparison, smollm2
# from examples/smollm2-chain-sum.toml; the threshold of smollm2 on chain_sum is about halfway
# from its first steps' reward to its last's (see docs/benchmarks.md).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"env": "reverse_text", "steps": 120, "sft_steps": 100, "sft_lr": 3e-3, "sft_batch_size": 32,
             "group_size": 16, "prompts_per_step": 8, "lr": 5e-4, "max_tokens": 16, "threshold": 0.45,
             "window": 10, "pack": False},
    "smollm2": {"env": "chain_sum", "steps": 30, "sft_steps": 10, "sft_lr": 2e-5, "sft_batch_size": 16,
                "group_size": 8, "prompts_per_step": 4, "lr": 1e-5, "max_tokens": 16, "threshold": 0.6,
                "window": 5, "pack": True,
                "task_config": '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'},
}
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s")


# --- the shared start: a warmed model and the task files ---------------------------------------

def env_of(args: argparse.Namespace, workload: str) -> tuple[str, dict[str, Any]]:
    """The environment id and arguments of a Flywheel run of ``workload``."""
    if args.env == "reverse_text":
        return ENV_OF[workload], {}
    return "flywheel/reasoning-tasks", {"task": args.env, "config": json.loads(args.task_config),
                                        "system_prompt": args.system_prompt, "max_tokens": args.max_tokens}


def warm_model(work: Path, args: argparse.Namespace) -> Path:
    """The model after ``--sft-steps`` of Flywheel's SFT warm-up on the environment's reference
    answers, saved as a Hugging Face folder."""
    import torch

    from flywheel.contract.config import RunConfig
    from flywheel.contract.settings import WorkersSettings
    from flywheel.sdk import models
    from flywheel_trainer.learner import sft_warmup, warmup_steps
    from flywheel_trainer.sft import references

    out = work / "warm-model"
    torch.manual_seed(0)
    env, env_args = env_of(args, "plain")
    cfg = RunConfig.parse({"run": "warm", "env": env, "env_args": env_args,
                           "sft": {"steps": args.sft_steps, "batch_size": args.sft_batch_size, "lr": args.sft_lr}},
                          source="warm-up")
    model, tok = models.load_model(models.resolve_model(args.model, work / "data"))
    examples = asyncio.run(references(cfg, WorkersSettings(), work / "data"))  # from the environment's workers
    figures = sft_warmup(model, warmup_steps(model, tok, examples, cfg), tok.pad_token_id, cfg,
                         micro_batch_size=args.sft_batch_size)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"warm-up: {args.model}, {args.sft_steps} SFT steps, loss {figures['sft_loss']:.3f}, saved to {out}",
          flush=True)
    return out


def write_tasks(path: Path, num: int, seed: int, args: argparse.Namespace) -> None:
    """The environment's first ``num`` tasks of ``seed`` (Flywheel's tasks for that seed), as TRL
    reads them (``benchmarks/trl_grpo.py``)."""
    if args.env == "reverse_text":
        import reverse_text

        env = reverse_text.load_environment()
    else:
        import reasoning_tasks

        env = reasoning_tasks.load_environment(**env_of(args, "plain")[1])
    with path.open("w") as f:
        for row in env.load_tasks(num, seed=seed):
            messages = [{"role": m.role, "content": m.content} for m in env.prompt_messages(row)]
            if args.env == "reverse_text":
                f.write(json.dumps({"prompt": messages, "text": row["text"]}) + "\n")
            else:
                item = {k: row[k] for k in ("task", "seed", "size", "index", "question")}
                f.write(json.dumps({"prompt": messages,
                                    "rg": json.dumps(item | {"config": json.loads(args.task_config)})}) + "\n")


# --- one run of each system ----------------------------------------------------------------------

SERVICE_OF = re.compile(r"(?P<fork>flywheel\.ops\.forkserver|fork server)|flywheel_(?P<service>\w+)"
                        r"|(?P<nats>nats-server)|(?P<workers>flywheel\.runtime\.envworker)|flywheel\.ops\.cli")


def tree_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of ``pid`` and every process below it (alive now), by process:
    a service's name (``inference``, ``trainer``, ``gateway``...), ``nats-server``,
    ``fork-server`` (its two processes, :mod:`flywheel.runtime.forkserver`), ``workers`` (the
    environment workers of every service, :mod:`flywheel.runtime.envworker`), ``run`` (the
    ``flywheel run`` process itself) or ``other``."""
    import psutil

    by_process: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return by_process
    for p in procs:
        try:
            t, cmdline = p.cpu_times(), " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        match = SERVICE_OF.search(cmdline)
        name = ("other" if match is None else "fork-server" if match["fork"] else "workers" if match["workers"]
                else match["service"] or match["nats"] or "run")
        if name == "gateway" and cmdline.split()[-1:] == ["recorder"]:
            name = "recorder"  # the gateway's second process
        by_process[name] = by_process.get(name, 0.0) + t.user + t.system
    return by_process


def figures(times: list[float], rewards: list[float], tokens: list[float], cpu_first: float, cpu_last: float,
            args: argparse.Namespace) -> dict[str, Any]:
    """A run's figures from its steps' end times (seconds since launch), rewards, trained tokens
    and CPU seconds at the first and the last step."""
    n = len(times)
    out: dict[str, Any] = {"num_steps": n, "startup_s": times[0], "step_s": (times[-1] - times[0]) / (n - 1),
                           "cpu_s_per_step": (cpu_last - cpu_first) / (n - 1),
                           "trained_tokens_per_s": sum(tokens[1:]) / (times[-1] - times[0]),
                           "steps_to_threshold": None, "time_to_threshold_s": None,
                           "reward_first": statistics.fmean(rewards[:args.window]),
                           "reward_last": statistics.fmean(rewards[-args.window:]), "rewards": rewards,
                           "step_end_s": [round(t, 3) for t in times]}
    for i in range(args.window - 1, n):
        if statistics.fmean(rewards[i - args.window + 1:i + 1]) >= args.threshold:
            out["steps_to_threshold"], out["time_to_threshold_s"] = i + 1, times[i] - times[0]
            break
    return out


def run_trl(work: Path, model: Path, tasks: Path, seed: int, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    out = work / f"trl-{workload}-{seed}.jsonl"
    argv = [str(TRL_PYTHON), str(TRL_SCRIPT), "--model", str(model), "--tasks", str(tasks), "--seed", str(seed),
            "--steps", str(args.steps), "--out", str(out),
            "--latency", "lognormal" if workload == "latency" else "none",
            "--lr", str(args.lr), "--max-tokens", str(args.max_tokens), "--group-size", str(args.group_size),
            "--prompts-per-step", str(args.prompts_per_step), "--threads", "1",
            "--reward", "reverse-text" if args.env == "reverse_text" else "reasoning-gym"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"TRL run failed ({done.returncode}): {done.stderr[-3000:]}")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [line for line in lines if "step" in line]
    return figures([s["t"] for s in steps], [s["reward"] for s in steps], [s["completion_tokens"] for s in steps],
                   steps[0]["cpu_s"], steps[-1]["cpu_s"], args)


def flywheel_config(path: Path, run: str, model: Path, seed: int, workload: str, off_policy: int,
                    args: argparse.Namespace) -> None:
    env, env_args = env_of(args, workload)
    path.write_text(f"""run = "{run}"
env = "{env}"
env_args = {toml_inline(env_args)}
group_size = {args.group_size}
seed = {seed}

[model]
name = "{model}"

[sampling]
temperature = 1.0
max_tokens = {args.max_tokens}

[sft]
steps = 0

[trainer]
batch_size = {args.group_size * args.prompts_per_step}
num_steps = {args.steps}
lr = {args.lr}
max_off_policy_steps = {off_policy}
pack = {str(args.pack).lower()}
advantage = {{type = "group_mean", normalize_std = false}}
loss = {{type = "clipped", clip_eps = 0.2}}
""")


def toml_inline(value: Any) -> str:
    """``value`` (tables, strings, numbers, booleans) as a TOML inline value."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value)  # a JSON string or number is a TOML one too


def checkout(rev: str, where: Path) -> Path:
    """Flywheel's files at git revision ``rev`` under ``where``, and a folder of links by import
    name to its packages (pyproject.toml's package-dir), to put first on PYTHONPATH; returns the links."""
    tree, links = where / "tree", where / "imports"
    tree.mkdir(parents=True)
    links.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    folders = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in folders.items():
        (links / name).symlink_to(tree / folder, target_is_directory=True)
    return links


def run_flywheel(work: Path, model: Path, seed: int, workload: str, off_policy: int,
                 args: argparse.Namespace, code: Path | None = None) -> dict[str, Any]:
    """One ``flywheel run``; ``code``: a folder of Flywheel's packages to import instead of the
    installed ones (:func:`checkout`)."""
    from flywheel.runtime.natsserver import free_port

    name = f"fw{off_policy}-{workload}-{seed}{'-baseline' if code else ''}"
    config, data_dir = work / f"{name}.toml", work / name
    flywheel_config(config, name, model, seed, workload, off_policy, args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(code or ""), str(ENVS), os.environ.get("PYTHONPATH")) if p),
               FLYWHEEL_TORCH_THREADS="1")
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(config), "--run-id", name,
            "--data-dir", str(data_dir), "--nats-port", str(free_port()), "--gateway-port", str(free_port()),
            "--inference-port", str(free_port())]
    launched_wall = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    cpu: dict[int, dict[str, float]] = {}
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            del tail[:-60]
            if args.verbose:
                print("   ", line.rstrip(), flush=True)
            match = STEP_LINE.match(line)
            if match and int(match.group(1)) in (1, args.steps):
                cpu[int(match.group(1))] = tree_cpu_s(proc.pid)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=args.timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    if proc.returncode != 0 or len(cpu) < 2:
        raise RuntimeError(f"flywheel run {name} failed ({proc.returncode}): {''.join(tail)}")
    lines = [json.loads(line) for line in (data_dir / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["step"] > 0]
    times = [datetime.fromisoformat(s["time"]).timestamp() - launched_wall for s in steps]
    per_step = {name: (cpu[args.steps].get(name, 0.0) - cpu[1].get(name, 0.0)) / (len(steps) - 1)
                for name in cpu[args.steps]}
    return figures(times, [s["reward_mean"] for s in steps], [s["num_loss_tokens"] for s in steps],
                   sum(cpu[1].values()), sum(cpu[args.steps].values()), args) | {
        "cpu_s_per_step_by_process": per_step,
        "num_dropped_stale": sum(s["num_dropped_stale"] for s in steps),
        "staleness_mean": statistics.fmean(s["staleness_mean"] for s in steps)}


# --- the comparison ------------------------------------------------------------------------------

def mean_of(runs: list[dict[str, Any]], system: str, workload: str, key: str) -> float | None:
    values = [r[key] for r in runs if r["system"] == system and r["workload"] == workload]
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(values)


def ratio(runs: list[dict[str, Any]], system: str, workload: str, key: str) -> float | None:
    ours, theirs = mean_of(runs, system, workload, key), mean_of(runs, "trl", workload, key)
    return None if ours is None or not theirs else ours / theirs


def summarize(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "flywheel_baseline" in systems:
        for key, field in (("cpu_s_per_step_ratio", "cpu_s_per_step"), ("startup_s_ratio", "startup_s"),
                           ("step_s_ratio_plain", "step_s")):
            ours = mean_of(runs, "flywheel_async", "plain", field)
            base = mean_of(runs, "flywheel_baseline", "plain", field)
            out[f"baseline_{key}"] = None if ours is None or not base else ours / base
    for system in [s for s in systems if s != "flywheel_baseline"]:
        prefix = "" if system == "flywheel_async" else "sync_"
        out[f"{prefix}cpu_s_per_step_ratio"] = ratio(runs, system, "plain", "cpu_s_per_step")
        out[f"{prefix}time_to_threshold_ratio_plain"] = ratio(runs, system, "plain", "time_to_threshold_s")
        out[f"{prefix}time_to_threshold_ratio_latency"] = ratio(runs, system, "latency", "time_to_threshold_s")
        out[f"{prefix}startup_s_ratio"] = ratio(runs, system, "plain", "startup_s")
        out[f"{prefix}step_s_ratio_plain"] = ratio(runs, system, "plain", "step_s")
        out[f"{prefix}step_s_ratio_latency"] = ratio(runs, system, "latency", "step_s")
    means = {}
    for system in ["trl", *systems]:
        for workload in ENV_OF:
            means[f"{system}/{workload}"] = {key: mean_of(runs, system, workload, key) for key in (
                "startup_s", "step_s", "cpu_s_per_step", "trained_tokens_per_s", "steps_to_threshold",
                "time_to_threshold_s", "reward_first", "reward_last")}
    out["time_to_threshold_ratio"] = out.get("time_to_threshold_ratio_plain")
    return out | {"means": means}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="the model; its defaults: PRESETS")
    p.add_argument("--env", help="reverse_text, or a reasoning-gym task's name (default: the model's preset)")
    p.add_argument("--task-config", help="the reasoning-gym task's settings, as JSON (default: the preset's)")
    p.add_argument("--system-prompt", default="direct", help="reasoning-gym's system prompt by name, or text")
    p.add_argument("--steps", type=int)
    p.add_argument("--workloads", help="plain,latency (reverse_text) or plain (default: all the env has)")
    p.add_argument("--sync", action="store_true", help="also run Flywheel synchronously (max_off_policy_steps 0)")
    p.add_argument("--baseline", metavar="REV", help="also run Flywheel as it is at git revision REV (asynchronous), "
                   "in turn with the others: baseline_* keys are this tree over it")
    p.add_argument("--sft-steps", type=int)
    p.add_argument("--sft-lr", type=float)
    p.add_argument("--sft-batch-size", type=int)
    p.add_argument("--group-size", type=int)
    p.add_argument("--prompts-per-step", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, help="Flywheel packs its rows (trainer.pack)")
    p.add_argument("--threshold", type=float, help="rolling mean reward to reach")
    p.add_argument("--window", type=int, help="steps in the rolling mean")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.model].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.task_config = args.task_config or "{}"
    if args.workloads is None:
        args.workloads = "plain,latency" if args.env == "reverse_text" else "plain"
    if args.env != "reverse_text" and args.workloads != "plain":
        p.error(f"--workloads {args.workloads}: a reasoning-gym task has the plain workload only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not TRL_PYTHON.exists():
        print(f"no TRL venv at {TRL_PYTHON}: run scripts/setup-trl.sh first", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ENVS))
    seeds = [int(s) for s in args.seeds.split(",")]
    workloads = args.workloads.split(",")
    systems = (["flywheel_async"] + (["flywheel_sync"] if args.sync else [])
               + (["flywheel_baseline"] if args.baseline else []))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = Path(tmp)
        baseline = checkout(args.baseline, work / "baseline") if args.baseline else None
        model = warm_model(work, args)
        for n, seed in enumerate(seeds):
            tasks = work / f"tasks-{seed}.jsonl"
            write_tasks(tasks, 4 * args.steps * args.prompts_per_step, seed, args)
            for workload in workloads:
                order = ["trl", *systems]
                if n % 2:
                    order.reverse()  # alternate who goes first, so a drift in load lands on both
                for system in order:
                    started = time.monotonic()
                    if system == "trl":
                        result = run_trl(work, model, tasks, seed, workload, args)
                    elif system == "flywheel_baseline":
                        result = run_flywheel(work, model, seed, workload, 1, args, code=baseline)
                    else:
                        result = run_flywheel(work, model, seed, workload, int(system == "flywheel_async"), args)
                    runs.append({"system": system, "workload": workload, "seed": seed, **result})
                    print(f"{system:15s} {workload:8s} seed {seed}: start-up {result['startup_s']:.1f}s, "
                          f"{result['step_s']:.3f} s/step, {result['cpu_s_per_step']:.3f} CPU-s/step, reward "
                          f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}, threshold at step "
                          f"{result['steps_to_threshold']} ({result['time_to_threshold_s']}s) "
                          f"[{time.monotonic() - started:.0f}s]", flush=True)
    out = summarize(runs, systems) | {"targets": TARGETS, "runs": runs, "config": {
        k: v for k, v in vars(args).items() if k not in ("json", "verbose")}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    for key, target in TARGETS.items():
        if key == "time_to_threshold_ratio_latency" and "latency" not in workloads:
            continue
        value = out[key]
        print(f"{key}: {'n/a' if value is None else f'{value:.3f}'} (target {target})")
    for system in ["trl", *systems]:
        value = out["means"][f"{system}/plain"]["trained_tokens_per_s"]
        print(f"trained_tokens_per_s {system}: {'n/a' if value is None else f'{value:.1f}'}")
    for key in ("step_s_ratio_plain", "step_s_ratio_latency") + (
            ("baseline_cpu_s_per_step_ratio", "baseline_startup_s_ratio", "baseline_step_s_ratio_plain")
            if args.baseline else ()):
        print(f"{key}: {out[key] if out[key] is None else round(out[key], 3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
