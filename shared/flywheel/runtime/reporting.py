"""What a run reports as it trains: its progress (every step's row), the step line and the
summary as ``flywheel run`` and ``runs follow`` print them, the summary and the reward plot its
owner writes into the run's folder."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.contract import events
from flywheel.contract.config import RunConfig


@dataclass
class Progress:
    """What the run printed so far; the summary and the plot are made from it."""

    started_s: float = field(default_factory=time.monotonic)
    steps: list[dict[str, float]] = field(default_factory=list)

    def add(self, update: events.WeightUpdate) -> dict[str, float] | None:
        if update.trainer_step == 0 or any(s["step"] == update.trainer_step for s in self.steps):
            return None
        row = {"step": float(update.trainer_step), "elapsed_s": time.monotonic() - self.started_s, **update.metrics}
        self.steps.append(row)
        return row


DROP_REASONS = {"stale": "stale", "scorer_error": "scorer error", "rollout_error": "rollout error",
                "signal_error": "teacher error"}


def format_dropped(row: dict[str, float]) -> str:
    """Rollouts dropped, with the reasons that count: ``3 (stale 1, scorer error 2)``."""
    by_reason = {label: int(row.get(f"num_dropped_{key}", 0.0)) for key, label in DROP_REASONS.items()}
    total = sum(by_reason.values())
    reasons = ", ".join(f"{label} {n}" for label, n in by_reason.items() if n)
    return f"{total} ({reasons})" if reasons else str(total)


def format_step(row: dict[str, float], num_steps: int, in_flight: int | None, metrics: Sequence[str] = ()) -> str:
    """One step's line; ``metrics``: the scorers of weight 0, shown by their step mean."""
    def get(key: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(row[key]) if key in row else "-"

    shown = "".join(f"  {name} {get(f'scores.{name}')}" for name in metrics)
    envs = [key.removeprefix("env.").removesuffix(".reward_mean") for key in row
            if key.startswith("env.") and key.endswith(".reward_mean")]
    if envs:
        shown = " (" + ", ".join(f"{name} {get(f'env.{name}.reward_mean')}" for name in envs) + ")" + shown
    if "echo_loss" in row:  # the cross-entropy on the environment's tokens (trainer.echo)
        shown += f"  echo loss {get('echo_loss')}"
    if "sft_term_loss" in row:  # the cross-entropy of the step's SFT term (trainer.sft_term)
        shown += f"  sft loss {get('sft_term_loss')}"
    if "distill_loss" in row:  # the dense distillation term's mean divergence (opd, estimate *_top_k)
        shown += f"  distill loss {get('distill_loss')}"
    if row.get("num_skipped_nonfinite"):  # the trainer's engine discarded the step's gradients
        shown += "  SKIPPED (loss or gradients not finite; weights unchanged)"
    for key in row:  # each teacher's per-token KL estimate (opd, trainer.kl)
        if key.startswith("teacher.") and key.endswith(".kl"):
            shown += f"  kl {key.removeprefix('teacher.').removesuffix('.kl')} {get(key)}"
    return (f"step {int(row['step']):>3}/{num_steps}  reward {get('reward_mean')}{shown}  "
            f"staleness {get('staleness_mean', '{:.2f}')} (max {get('staleness_max', '{:.0f}')})  "
            f"dropped {format_dropped(row)}  tokens/s train {get('tokens_per_s', '{:.0f}')} "
            f"sample {get('sampled_tokens_per_s', '{:.0f}')}  "
            f"in flight {in_flight if in_flight is not None else '-'}  t {row['elapsed_s']:.1f}s")


def summarize(progress: Progress, cfg: RunConfig, run_dir: Path, metrics: Sequence[str] = ()) -> dict[str, Any]:
    """The run's figures; ``metrics`` (the scorers of weight 0) by their mean over the first and
    the last quarter of the steps, as the reward is."""
    rewards = [s["reward_mean"] for s in progress.steps if "reward_mean" in s]
    k = max(1, len(rewards) // 4)
    first, last = rewards[:k], rewards[-k:]
    quarters: dict[str, float | None] = {}
    for name in metrics:
        values = [s[f"scores.{name}"] for s in progress.steps if f"scores.{name}" in s]
        quarters[f"{name}_first"] = sum(values[:k]) / len(values[:k]) if values else None
        quarters[f"{name}_last"] = sum(values[-k:]) / len(values[-k:]) if values else None
    for name in env_names(progress):  # a run with several environments: each one's, the same way
        values = [s[f"env.{name}.reward_mean"] for s in progress.steps if f"env.{name}.reward_mean" in s]
        quarters[f"env.{name}.reward_first"] = sum(values[:k]) / len(values[:k]) if values[:k] else None
        quarters[f"env.{name}.reward_last"] = sum(values[-k:]) / len(values[-k:]) if values[-k:] else None
    for key in ["echo_loss", "sft_term_loss", *sorted({key for s in progress.steps for key in s
                                      if key.startswith("teacher.") and key.endswith(".kl")})]:
        # trainer.echo: how well the policy predicts its environment; the SFT term's cross-entropy;
        # a teacher's KL estimate: how far the policy is from it; each at the start and the end
        values = [s[key] for s in progress.steps if key in s]
        if values:
            quarters[f"{key}_first"] = sum(values[:k]) / len(values[:k])
            quarters[f"{key}_last"] = sum(values[-k:]) / len(values[-k:])
    dropped = {f"num_dropped_{key}": sum(s.get(f"num_dropped_{key}", 0.0) for s in progress.steps)
               for key in DROP_REASONS}
    return {
        "run": cfg.run,
        "env": cfg.env_ids,
        "model": cfg.model.name,
        "steps": len(progress.steps),
        "elapsed_s": progress.steps[-1]["elapsed_s"] if progress.steps else 0.0,
        "reward_first": sum(first) / len(first) if first else None,
        "reward_last": sum(last) / len(last) if last else None,
        "reward_gain": (sum(last) / len(last) - sum(first) / len(first)) if rewards else None,
        "window_steps": k,
        **quarters,
        **dropped,
        "staleness_max": max((s.get("staleness_max", 0.0) for s in progress.steps), default=0.0),
        "tokens_per_s_mean": (sum(s.get("tokens_per_s", 0.0) for s in progress.steps) / len(progress.steps)
                              if progress.steps else 0.0),
        "run_dir": str(run_dir),
    }


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    width = max(len(k) for k in summary)
    return "\n".join(f"  {k.ljust(width)}  {fmt(v)}" for k, v in summary.items())


def format_errors(groups: Sequence[events.ErrorGroup]) -> str:
    """A run's error groups (``RunState.errors``), one line each: count, where, the first one's
    text and rollout (whose trace shows the error: ``/rollouts/ID`` on the gateway)."""
    width = max(len(str(g.count)) for g in groups)
    return "\n".join(f"  {str(g.count).rjust(width)}  {g.source}: {g.error} (e.g. rollout {g.example})"
                     for g in groups)


def env_names(progress: Progress) -> list[str]:
    """The environments a run with several reports apart (``env.<name>.reward_mean`` in the
    trainer's metrics), in the order they first appear; [] for a run with one."""
    names: dict[str, None] = {}
    for step in progress.steps:
        for key in step:
            if key.startswith("env.") and key.endswith(".reward_mean"):
                names[key.removeprefix("env.").removesuffix(".reward_mean")] = None
    return list(names)


def plot(progress: Progress, path: Path, title: str, evals: Sequence[dict[str, Any]] = ()) -> Path | None:
    """The reward curve as a PNG, a curve for each environment of a run with several beside the
    overall one, and the points of each eval during training (``evals``: rows of the run's
    ``evals.jsonl``); None when matplotlib (the ``run`` extra) is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    envs = env_names(progress)
    for key, label in [("reward_mean", "all environments" if envs else None),
                       *((f"env.{name}.reward_mean", name) for name in envs)]:
        steps = [s["step"] for s in progress.steps if key in s]
        ax.plot(steps, [s[key] for s in progress.steps if key in s], marker="o", markersize=3, label=label,
                linewidth=2.0 if key == "reward_mean" else 1.2)
    for name in dict.fromkeys(row["eval"] for row in evals):
        points = sorted((row["step"], row["reward_mean"]) for row in evals
                        if row["eval"] == name and row.get("reward_mean") is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="s", markersize=5, linestyle="--",
                label=f"eval {name}")
    if envs or evals:
        ax.legend(fontsize=8)
    return save_plot(fig, ax, path, title, "trainer step", "mean reward of the step's rollouts")


def save_plot(fig: Any, ax: Any, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    """Label, title and grid ``ax`` as every plot of a run is, write ``fig`` to ``path`` and close it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
