"""An eval's results file and its statistics: rollouts read back (a torn last line skipped),
scores as result fields, reward mean and standard error, pass@k, errors grouped by kind with a
count and an example."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flywheel.contract import events


def read_results(path: Path) -> list[dict[str, Any]]:
    """The rollouts in a results file; a torn last line (an eval killed mid-write) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "task_id" in record and "index" in record:
            out.append(record)
    return out


def scored_fields(scores: Sequence[events.Score]) -> dict[str, Any]:
    """A rollout's scores as results fields: ``rewards`` (values of those without an error),
    ``components`` (of those that have some) and ``reward_errors``."""
    return {"rewards": {s.scorer: s.value for s in scores if s.error is None},
            "components": {s.scorer: s.components for s in scores if s.error is None and s.components},
            "reward_errors": {s.scorer: s.error for s in scores if s.error is not None}}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with ``c`` passing rollouts of ``n``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_stderr(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


MAX_EXAMPLE_CHARS = 500  # an error kind's example message, cut to this


def error_kind(message: str) -> str:
    """A rollout's (or reward's) error message as its kind, so that errors of one cause group
    together: its first clause (up to ``": "`` or ``"; "``), with the exception type after a
    prefix kept (``harness failed: NotFoundError``), quoted values, ``=values`` and numbers
    blanked (``the harness ran past rollout_timeout_s``)."""
    text = (message.strip().splitlines() or ["(no message)"])[0]
    parts = re.split(r": |; ", text)
    kind = parts[0]
    if len(parts) > 1 and re.fullmatch(r"[A-Z][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", parts[1]):
        kind += ": " + parts[1]  # an exception's type, after a prefix that says where it was raised
    kind = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", kind)
    kind = re.sub(r"=\S+", "", kind)
    kind = re.sub(r"\d+", "N", kind)
    return kind[:200] or "(no message)"


def error_kinds(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The errors of ``records`` by kind (:func:`error_kind`), most frequent first: each with its
    ``count`` and one ``example`` message (the first seen) and its ``rollout_id``. A rollout's
    error is ``rollout``'s; a reward's is ``reward NAME``'s."""
    kinds: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        found = [("rollout", r["error"])] if r.get("error") else []
        found += [(f"reward {name}", message) for name, message in (r.get("reward_errors") or {}).items()]
        for where, message in found:
            text = str(message)
            key = (where, error_kind(text))
            entry = kinds.setdefault(key, {"where": where, "kind": key[1], "count": 0,
                                           "example": text[:MAX_EXAMPLE_CHARS], "rollout_id": r.get("rollout_id")})
            entry["count"] += 1
    return sorted(kinds.values(), key=lambda e: (-e["count"], e["where"], e["kind"]))


def summarize(records: Sequence[Mapping[str, Any]], weights: Mapping[str, float], num_rollouts: int,
              pass_threshold: float) -> dict[str, Any]:
    """Reward mean and standard error (overall and per reward), pass@k, errors by kind, tokens.

    Every figure of the rewards (their means, standard errors and pass@k) is over the rollouts
    without an error (``num_scored``; an errored rollout's harness never finished, so what its
    rewards say of it is not the model's): ``reward_mean`` also leaves out a rollout one of whose
    rewards failed (its reward is not known), each reward's ``num`` says how many it is over."""
    scored = [r for r in records if not r.get("error")]
    rewards = [r["reward"] for r in scored if r.get("reward") is not None]
    mean, stderr = mean_stderr(rewards)
    per_reward = {}
    for name in weights:
        values = [r["rewards"][name] for r in scored if name in r.get("rewards", {})]
        m, s = mean_stderr(values)
        per_reward[name] = {"mean": m, "stderr": s, "weight": weights[name], "num": len(values)}
    by_task: dict[str, list[bool]] = {}
    for r in records:
        by_task.setdefault(r["task_id"], [])
    for r in scored:
        # A hair of tolerance: weighted sums of floats (0.1 + 0.2) should pass a threshold they meet.
        passed = r.get("reward") is not None and r["reward"] >= pass_threshold - 1e-9
        by_task[r["task_id"]].append(passed)
    pass_k = {}
    for k in range(1, num_rollouts + 1):
        groups = [g for g in by_task.values() if len(g) >= k]
        pass_k[f"pass@{k}"] = sum(pass_at_k(len(g), sum(g), k) for g in groups) / len(groups) if groups else None
    return {
        "num_tasks": len(by_task),
        "num_rollouts": len(records),
        "num_scored": len(scored),
        "num_rewarded": len(rewards),
        "reward_mean": mean,
        "reward_stderr": stderr,
        "pass_threshold": pass_threshold,
        **pass_k,
        "rewards": per_reward,
        "num_errors": len(records) - len(scored),
        "num_reward_errors": sum(1 for r in records if r.get("reward_errors")),
        "errors": error_kinds(records),
        "num_truncated": sum(1 for r in records if r.get("status") == "truncated"),
        "prompt_tokens": sum(r.get("usage", {}).get("prompt_tokens", 0) for r in records),
        "completion_tokens": sum(r.get("usage", {}).get("completion_tokens", 0) for r in records),
    }
