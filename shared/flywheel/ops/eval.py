"""How ``flywheel eval`` shows an eval's summary (the eval itself: :mod:`flywheel.runtime.evaluation`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flywheel.ops.tables import table


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a table: one row per figure, reward rows with their standard error."""

    def num(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    rows: list[list[str]] = [["reward", num(summary["reward_mean"]), num(summary["reward_stderr"])]]
    for name, r in summary["rewards"].items():
        rows.append([f"  {name} (weight {r['weight']:g})", num(r["mean"]), num(r["stderr"])])
    rows += [[k, num(v), ""] for k, v in summary.items() if k.startswith("pass@")]
    rows += [[k, num(summary[k]), ""] for k in ("num_tasks", "num_rollouts", "num_errors", "num_reward_errors",
                                                 "num_truncated", "prompt_tokens", "completion_tokens")]
    text = table(rows, ["", "mean", "stderr"]) + f"\npass: reward >= {summary['pass_threshold']:g}"
    if "num_scored" in summary:
        text += (f"\nrewards and pass@k are over the {summary['num_scored']} of {summary['num_rollouts']} rollouts "
                 f"without an error" + (f" ({summary['num_errors']} errored, left out)" if summary["num_errors"]
                                        else "")
                 + (f"; reward over the {summary['num_rewarded']} whose every reward was computed"
                    if summary.get("num_rewarded", summary["num_scored"]) != summary["num_scored"] else ""))
    if summary.get("errors"):
        text += "\nerrors by kind:"
        for e in summary["errors"]:
            text += f"\n  {e['count']:>5} x {e['where']}: {e['kind']}\n        e.g. {e['example']}"
    if summary.get("sampling"):
        given = {k: v for k, v in summary["sampling"].items() if v not in (None, [])}
        text += "\nsampled with: " + ", ".join(f"{k} {v}" for k, v in given.items())
    return text
