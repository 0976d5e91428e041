"""The GPU check: the trainer, the inference backend and DeepSpeed ZeRO on one CUDA device.

    python benchmarks/gpu_check.py --json out/gpu_check.json              # CUDA, bfloat16
    python benchmarks/gpu_check.py --device cpu --json out/gpu_cpu.json   # the same on CPU, float32

One prepared script for the one short window on a lent GPU (an H200 here), which runs
end to end on CPU too so it is tested before the window. It writes JSON to ``--json``, or
to ``$OUT/gpu_check.json`` where ``OUT`` is set, and exits 1 when a check failed. Checks,
each independent (one failing does not stop the others):

- ``inference``: the transformers backend (:class:`flywheel_inference.backends.TransformersBackend`)
  on the device in the run's dtype: batched sampling throughput, the same tokens again for
  the same seeds and batch, and the agreement of its logprobs with the trainer's
  recomputation (:func:`flywheel_trainer.batch.token_logprobs` through the torch engine,
  float32 weights under bf16 autocast) on the sampled tokens: the gap an on-policy step
  sees as ``logprob_diff_abs_mean``. Bounds: ``LOGPROB_BOUNDS`` (bf16 rounds, float32
  should not).
- ``rl_loop``: a small synchronous RL loop through the real parts: sample groups with the
  backend, build the rollouts as the inference worker does, reward them with the
  environment (``reverse_text``), :func:`flywheel_trainer.learner.rl_step` on the torch
  engine, then the weights back into the backend (``engine.weights()`` -> ``backend.swap``).
  Per step: reward, loss, gradient norm, logprob gap, and the time of each part.
- ``deepspeed_zero<N>``: :class:`flywheel_trainer.engines.DeepSpeedEngine` for each stage of
  ``--zero-stages``, stepped on the same fixed groups as a torch engine from the same
  weights (``deepspeed_torch_reference``): the losses of every step and the weights after
  the last must agree with torch's within ``DEEPSPEED_BOUNDS``, the weights must have moved,
  and the gathered weights must load into the backend.
- ``large``: ``inference`` and ``rl_loop`` again on a SmolLM2-135M-shaped Qwen2 (random
  weights, the tiny tokenizer; SmolLM2 itself does not fit the 64 MiB a device call may
  carry). On by default on CUDA, ``--large`` asks for it on CPU too.

On the device machine nothing is installed: this script makes the repository's packages
importable from the checkout itself (:func:`ensure_importable`), and the packages missing
from that image travel as wheels in ``.whl`` (what the packages import beyond torch and
transformers: msgspec, pydantic and pydantic-settings, fastapi, nats-py, opentelemetry, httpx,
deepspeed and their parts, about 8 MB), installed to /tmp/site at the start of the call. To
prepare them here (Python 3.12 wheels for the device's interpreter; deepspeed as a pure-Python
wheel built locally)::

    echo /.whl/ >> .git/info/exclude
    .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
        msgspec pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson \
        pydantic-settings python-dotenv fastapi starlette anyio sniffio idna annotated-doc \
        python-multipart nats-py msgpack h11 httpx httpcore certifi protobuf \
        googleapis-common-protos opentelemetry-api opentelemetry-sdk \
        opentelemetry-semantic-conventions opentelemetry-proto opentelemetry-exporter-otlp-proto-http \
        opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common \
        opentelemetry-exporter-http-transport httpx2 httpcore2 truststore
    .venv/bin/pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8

and run, carrying ``.whl``, with about 420 s of time::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
      && PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json

Not covered: vLLM (its wheel does not fit), several GPUs or ranks, LoRA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# import name -> folder in the checkout (pyproject's package-dir)
PACKAGES = {"flywheel": "shared/flywheel", "flywheel_inference": "services/inference",
            "flywheel_trainer": "services/trainer", "reverse_text": "environments/reverse_text"}
# dtype -> (mean, max) bound on |sampler logprob - trainer logprob| over sampled tokens
LOGPROB_BOUNDS = {"float32": (1e-3, 1e-2), "bfloat16": (5e-2, 1.0)}
# dtype -> bounds on how far DeepSpeed's steps are from torch's on the same data: the largest
# loss gap over the steps, the largest parameter gap after them. float32: the same
# arithmetic; bfloat16 (DeepSpeed's bf16 weights against torch's autocast): a sanity bound,
# under the movement of the steps themselves (lr 2e-3 a step).
DEEPSPEED_BOUNDS = {"float32": (1e-5, 1e-4), "bfloat16": (5e-3, 5e-3)}
LARGE_SHAPE = {"hidden_size": 576, "num_layers": 30, "num_heads": 9, "intermediate_size": 1536,
               "max_positions": 2048}  # SmolLM2-135M's shape (its grouped KV heads aside)


def ensure_importable() -> None:
    """Import the repository's packages from this checkout where they are not installed."""
    try:
        import flywheel_inference  # noqa: F401  # imported only to learn whether it can be
        import flywheel_trainer  # noqa: F401  # imported only to learn whether it can be
        import reverse_text  # noqa: F401  # imported only to learn whether it can be
        return
    except ImportError:
        pass
    links = Path(tempfile.mkdtemp(prefix="flywheel-packages-"))
    for name, folder in PACKAGES.items():
        (links / name).symlink_to(ROOT / folder, target_is_directory=True)
    sys.path.insert(0, str(links))


def out_path(args: argparse.Namespace) -> Path | None:
    if args.json:
        return Path(args.json)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return None


class Checks:
    """Runs each check, keeps its figures or its traceback, prints as it goes."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        import torch

        print(f"--- {name}", flush=True)
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            figures = fn()
        except Exception as exc:
            traceback.print_exc()
            self.results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc(), "wall_s": time.perf_counter() - started}
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})", flush=True)
            return None
        figures["wall_s"] = time.perf_counter() - started
        if self.device == "cuda":
            figures["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.results[name] = figures
        shown = {k: v for k, v in figures.items() if not isinstance(v, list | dict)}
        print(f"{name}: {'ok' if figures.get('ok', True) else 'NOT ok'}  " + "  ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items() if k != "ok"), flush=True)
        return figures


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(device: str, into: dict[str, float], key: str) -> Iterator[None]:
    sync(device)
    started = time.perf_counter()
    yield
    sync(device)
    into[key] = into.get(key, 0.0) + time.perf_counter() - started


def run_config(dtype: str, engine: str = "torch", stage: int = 0, max_tokens: int = 16) -> Any:
    from flywheel.contract.config import RunConfig

    return RunConfig.parse({
        "run": "gpu-check", "env": "reverse_text", "group_size": 8,
        "model": {"dtype": dtype}, "sampling": {"temperature": 1.0, "max_tokens": max_tokens},
        "trainer": {"engine": {"type": engine, "zero_stage": stage} if engine == "deepspeed" else engine,
                    "batch_size": 64, "lr": 2e-3},
    }, source="gpu check")


class Sampler:
    """Groups of rollouts from the backend, built as the inference worker builds them."""

    def __init__(self, backend: Any, cfg: Any) -> None:
        from flywheel.sdk.environment import load_environment

        self.backend = backend
        self.cfg = cfg
        self.env = load_environment(cfg.env)
        self.tasks = self.env.load_tasks(1000, seed=0)
        self.next_task = 0

    def groups(self, num_groups: int, seed: int) -> list[list[Any]]:
        from flywheel.contract import events
        from flywheel.sdk.tracegraph import TraceGraph
        from flywheel_inference.interception import Renderer, record
        from flywheel_trainer.join import Scored

        cfg, renderer = self.cfg, Renderer(self.backend.tokenizer)
        sampling = events.Sampling(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                                   max_tokens=cfg.sampling.max_tokens)
        rows = [self.tasks[(self.next_task + g) % len(self.tasks)] for g in range(num_groups)]
        self.next_task += num_groups
        prompts, built = [], []
        for g, row in enumerate(rows):
            task = events.Task(id=f"task-{seed}-{g}", run=cfg.run, env=cfg.env, data=row, num_rollouts=cfg.group_size)
            plan = renderer.plan(TraceGraph(), self.env.prompt_messages(row), None, True)
            built.append((task, plan))
            prompts += [plan.prompt_ids] * cfg.group_size
        seeds = [seed * 100_000 + i for i in range(len(prompts))]
        completions = self.backend.generate(prompts, sampling, seeds)
        version = self.backend.version
        reward = self.env.rollout_rewards["similarity"].fn
        groups = []
        for g, (task, plan) in enumerate(built):
            group = []
            for i in range(cfg.group_size):
                c = completions[g * cfg.group_size + i]
                graph = TraceGraph()
                record(graph, plan, c, version, texts=renderer.token_texts)
                rollout = events.Rollout(run=task.run, env=task.env, task_id=task.id, group_id=task.id, index=i,
                                         policy_version=version, task_data=task.data, nodes=graph.ordered(),
                                         group_size=cfg.group_size)
                group.append(Scored(rollout, float(reward(c.text, task.data)), 0))
            groups.append(group)
        return groups


def build_model(folder: Path, shape: dict[str, int] | None) -> Path:
    from flywheel.sdk import models

    if not (folder / "config.json").exists():
        models.build_tiny(folder, **(shape or {}))
    return folder


def torch_engine(model_dir: Path, cfg: Any) -> Any:
    from flywheel.sdk import models
    from flywheel_trainer.engines import build_engine

    model, _ = models.load_model(model_dir, "float32")
    return build_engine(model, cfg.trainer, cfg.model.dtype)


def logprob_gap(engine: Any, groups: list[list[Any]], pad_id: int, temperature: float) -> dict[str, float]:
    """|sampler logprob - trainer logprob| over the sampled tokens (same weights on both sides)."""
    import torch

    from flywheel_trainer.batch import pad, token_logprobs
    from flywheel_trainer.join import tokens_of

    sequences = [tokens_of(s.rollout) for g in groups for s in g]
    batch = pad(sequences, [0.0] * len(sequences), pad_id, engine.device, [temperature] * len(sequences))
    with torch.no_grad(), engine.autocast():
        logprobs = token_logprobs(engine.model, batch)
    gap = (logprobs.float() - batch.old_logprobs).abs()[batch.loss_mask]
    ratio = torch.exp(batch.old_logprobs - logprobs.float())[batch.loss_mask]
    return {"logprob_gap_mean": float(gap.mean()), "logprob_gap_max": float(gap.max()),
            "importance_ratio_abs_dev_mean": float((ratio - 1).abs().mean()), "num_tokens_compared": int(gap.numel())}


def check_inference(model_dir: Path, device: str, dtype: str, batch_size: int, max_tokens: int) -> dict[str, Any]:
    from flywheel.sdk import models
    from flywheel_inference.backends import TransformersBackend

    cfg = run_config(dtype, max_tokens=max_tokens)
    backend = TransformersBackend.build(model_dir, dtype, device)
    engine = torch_engine(model_dir, cfg)
    backend.swap(models.save_weights(engine.module), 0)  # the trainer's weights, as version 0
    sampler = Sampler(backend, cfg)
    num_groups = max(1, batch_size // cfg.group_size)
    sampler.groups(1, seed=1)  # warm-up (kernels, allocator)
    t: dict[str, float] = {}
    with timed(device, t, "generate_s"):
        groups = sampler.groups(num_groups, seed=2)
    sampler.next_task -= num_groups
    again = sampler.groups(num_groups, seed=2)
    same = [s.rollout.nodes[-1].tokens.token_ids for g in groups for s in g] == \
           [s.rollout.nodes[-1].tokens.token_ids for g in again for s in g]
    num_tokens = sum(len(s.rollout.nodes[-1].tokens.token_ids) for g in groups for s in g)
    gap = logprob_gap(engine, groups, backend.pad_id, cfg.sampling.temperature)
    mean_bound, max_bound = LOGPROB_BOUNDS[dtype]
    ok = same and gap["logprob_gap_mean"] <= mean_bound and gap["logprob_gap_max"] <= max_bound
    return {"ok": ok, "num_sequences": num_groups * cfg.group_size, "max_tokens": max_tokens,
            "generated_tokens": num_tokens, "generate_s": t["generate_s"],
            "generated_tokens_per_s": num_tokens / t["generate_s"], "same_tokens_for_same_seeds": same,
            **gap, "logprob_gap_bounds": [mean_bound, max_bound],
            "num_parameters": sum(p.numel() for p in backend.model.parameters())}


def check_rl_loop(model_dir: Path, device: str, dtype: str, num_steps: int, max_tokens: int) -> dict[str, Any]:
    from flywheel.contract.settings import TrainerSettings
    from flywheel_inference.backends import TransformersBackend
    from flywheel_trainer.learner import rl_step

    cfg = run_config(dtype, max_tokens=max_tokens)
    engine = torch_engine(model_dir, cfg)
    backend = TransformersBackend.build(model_dir, dtype, device)
    backend.swap(engine.weights(), 0)
    sampler = Sampler(backend, cfg)
    settings = TrainerSettings()
    steps = []
    for step in range(1, num_steps + 1):
        t: dict[str, float] = {}
        with timed(device, t, "generate_s"):
            groups = sampler.groups(cfg.groups_per_step, seed=10 + step)
        with timed(device, t, "train_s"):
            figures = rl_step(engine, groups, backend.pad_id, cfg, settings.micro_batch_size,
                              micro_batch_tokens=settings.micro_batch_tokens)
        with timed(device, t, "weights_s"):
            data = engine.weights()
        with timed(device, t, "swap_s"):
            backend.swap(data, step)
        rewards = [s.reward for g in groups for s in g]
        row = {"step": step, "reward_mean": sum(rewards) / len(rewards), "loss": figures["loss"],
               "grad_norm": figures["grad_norm"], "logprob_diff_abs_mean": figures["logprob_diff_abs_mean"],
               "tokens_per_s": figures["tokens_per_s"], "weights_bytes": len(data), **t}
        steps.append(row)
        print(f"  step {step}: reward {row['reward_mean']:.3f}  loss {row['loss']:.4f}  grad_norm "
              f"{row['grad_norm']:.3f}  logprob diff {row['logprob_diff_abs_mean']:.2e}  generate "
              f"{t['generate_s']:.3f}s  train {t['train_s']:.3f}s  weights {t['weights_s']:.3f}s  swap "
              f"{t['swap_s']:.3f}s", flush=True)
    mean_bound, _ = LOGPROB_BOUNDS[dtype]
    finite = all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    on_policy_gap = max(r["logprob_diff_abs_mean"] for r in steps)  # every step trains on its own samples
    timed_steps = steps[1:] or steps  # the first step warms kernels up
    return {"ok": finite and on_policy_gap <= mean_bound, "num_steps": num_steps,
            "on_policy_logprob_diff_max": on_policy_gap,
            **{f"{k}_mean": sum(r[k] for r in timed_steps) / len(timed_steps)
               for k in ("generate_s", "train_s", "weights_s", "swap_s", "tokens_per_s")},
            "steps": steps}


def max_weight_gap(a: bytes, b: bytes) -> float:
    from safetensors.torch import load

    x, y = load(a), load(b)
    assert x.keys() == y.keys(), "the two engines publish different tensors"
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def check_deepspeed(model_dir: Path, device: str, dtype: str, stage: int, num_steps: int,
                    fixed: tuple[list[list[Any]], int], reference: dict[str, Any]) -> dict[str, Any]:
    from flywheel.contract.settings import TrainerSettings
    from flywheel_inference.backends import TransformersBackend
    from flywheel_trainer.learner import rl_step

    cfg = run_config(dtype, engine="deepspeed", stage=stage)
    engine = torch_engine(model_dir, cfg)
    groups, pad_id = fixed
    losses, step_s = [], []
    for _ in range(num_steps):
        t: dict[str, float] = {}
        with timed(device, t, "step_s"):
            figures = rl_step(engine, groups, pad_id, cfg, TrainerSettings().micro_batch_size,
                              micro_batch_tokens=TrainerSettings().micro_batch_tokens)
        losses.append(figures["loss"])
        step_s.append(t["step_s"])
    with timed(device, t, "weights_s"):
        data = engine.weights()
    backend = TransformersBackend.build(model_dir, dtype, device)
    backend.swap(data, num_steps)  # the gathered weights load where inference loads them
    loss_bound, weight_bound = DEEPSPEED_BOUNDS[dtype]
    loss_gap = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
    weight_gap = max_weight_gap(data, reference["weights"])
    moved = max_weight_gap(data, reference["initial_weights"])
    ok = all(math.isfinite(x) for x in losses) and loss_gap <= loss_bound and weight_gap <= weight_bound and moved > 0
    timed_steps = step_s[1:] or step_s
    return {"ok": ok, "stage": stage, "losses": losses, "torch_losses": reference["losses"],
            "loss_gap_to_torch_max": loss_gap, "weight_gap_to_torch_max": weight_gap, "weights_moved_max": moved,
            "bounds": [loss_bound, weight_bound],
            "step_s_mean": sum(timed_steps) / len(timed_steps), "weights_s": t["weights_s"],
            "weights_bytes": len(data)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--json", metavar="OUT", help="write the figures here (default: $OUT/gpu_check.json)")
    parser.add_argument("--steps", type=int, default=5, help="RL steps per check")
    parser.add_argument("--batch-size", type=int, default=256, help="sequences sampled together in `inference`")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--zero-stages", default="0,1,2,3", help="DeepSpeed ZeRO stages, comma-separated; '' for none")
    parser.add_argument("--large", action=argparse.BooleanOptionalAction, default=None,
                        help="also check a SmolLM2-135M-shaped model (default: on CUDA only)")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engines pick CUDA whenever they see it
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    large = args.large if args.large is not None else args.device == "cuda"
    ensure_importable()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": args.device, "dtype": dtype, "torch": torch.__version__, "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    for name in ("transformers", "deepspeed"):
        try:
            report[name] = __import__(name).__version__
        except ImportError:
            report[name] = None
    print(json.dumps(report), flush=True)
    checks = Checks(args.device)
    work = Path(tempfile.mkdtemp(prefix="flywheel-gpu-check-"))
    tiny = build_model(work / "tiny", None)

    checks.run("inference", lambda: check_inference(tiny, args.device, dtype, args.batch_size, args.max_tokens))
    checks.run("rl_loop", lambda: check_rl_loop(tiny, args.device, dtype, args.steps, args.max_tokens))

    stages = [int(s) for s in args.zero_stages.split(",") if s.strip()]
    if stages:
        fixed: dict[str, Any] = {}

        def torch_reference() -> dict[str, Any]:
            from flywheel.contract.settings import TrainerSettings
            from flywheel_inference.backends import TransformersBackend
            from flywheel_trainer.learner import rl_step

            cfg = run_config(dtype)
            backend = TransformersBackend.build(tiny, dtype, args.device)
            engine = torch_engine(tiny, cfg)
            initial = engine.weights()
            backend.swap(initial, 0)
            fixed["groups"] = (Sampler(backend, cfg).groups(cfg.groups_per_step, seed=99), backend.pad_id)
            losses = [rl_step(engine, fixed["groups"][0], backend.pad_id, cfg, TrainerSettings().micro_batch_size,
                              micro_batch_tokens=TrainerSettings().micro_batch_tokens)["loss"]
                      for _ in range(args.steps)]
            fixed["reference"] = {"losses": losses, "weights": engine.weights(), "initial_weights": initial}
            return {"ok": all(math.isfinite(x) for x in losses), "losses": losses}

        if report["deepspeed"] is None:
            checks.results["deepspeed"] = {"ok": False, "error": "deepspeed is not importable (carry its wheel)"}
            print("deepspeed: NOT importable, skipped", flush=True)
        elif checks.run("deepspeed_torch_reference", torch_reference) is not None:
            for stage in stages:
                def zero(stage: int = stage) -> dict[str, Any]:
                    return check_deepspeed(tiny, args.device, dtype, stage, args.steps, fixed["groups"],
                                           fixed["reference"])

                checks.run(f"deepspeed_zero{stage}", zero)

    if large:
        big = build_model(work / "large", LARGE_SHAPE)
        checks.run("large_inference", lambda: check_inference(big, args.device, dtype, args.batch_size,
                                                              args.max_tokens))
        checks.run("large_rl_loop", lambda: check_rl_loop(big, args.device, dtype, min(args.steps, 3),
                                                          args.max_tokens))

    report["checks"] = checks.results
    report["ok"] = all(r.get("ok", True) for r in checks.results.values())
    report["wall_s"] = time.perf_counter() - started
    failed = [name for name, r in checks.results.items() if not r.get("ok", True)]
    print(f"gpu check: {'all ok' if not failed else 'FAILED: ' + ', '.join(failed)} in {report['wall_s']:.0f}s")
    path = out_path(args)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
