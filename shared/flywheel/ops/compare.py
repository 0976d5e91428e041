"""``flywheel eval ENV --models a,b,c``: several models on the same tasks, side by side.

Each model is one :func:`flywheel.runtime.evaluation.run_eval` with the same environment, task draw (seed),
rollouts per task and sampling, so the rows of the report are comparable task by task. The
report (markdown, JSON and a PNG) gives per model: reward mean ± standard error, pass@k, tokens,
cost (from a price table), errors; and per pair of models a **paired** comparison over the tasks
both answered: the mean of the per-task reward differences, its standard error, and a two-sided
p-value from a sign-flip permutation test (exact up to 16 tasks, else 10,000 seeded draws), which
assumes nothing about the rewards' distribution.

A model is ``NAME`` (at ``--base-url``) or ``NAME@URL`` (its own OpenAI-compatible endpoint).
The price table is a TOML file, a table per model name::

    ["gpt-x"]
    prompt_per_mtok = 1.25
    completion_per_mtok = 10.0
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.runtime.evalresults import read_results
from flywheel.runtime.evaluation import EvalConfig, Serving, run_eval

if TYPE_CHECKING:
    from flywheel.contract.settings import Settings

PRICE_KEYS = ("prompt_per_mtok", "completion_per_mtok")
EXACT_UP_TO = 16  # tasks; above, the permutation test draws
NUM_DRAWS = 10_000


@dataclass(frozen=True)
class ModelSpec:
    name: str
    base_url: str


def parse_models(text: str, base_url: str) -> list[ModelSpec]:
    """``a,b@http://host/v1,c``: each model at ``base_url`` unless it names its own."""
    specs = []
    for i, entry in enumerate(part.strip() for part in text.split(",")):
        name, _, url = entry.partition("@")
        if not name:
            raise ValueError(f"--models {text!r}: entry {i + 1} is empty; give NAME or NAME@URL, comma-separated")
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"--models: {entry!r}: after @ comes the endpoint's URL (http://HOST/v1), got {url!r}")
        specs.append(ModelSpec(name, url or base_url))
    if len(specs) < 2:
        raise ValueError(f"--models {text!r}: name at least two models to compare (one: use --model)")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--models {text!r}: a model is named twice")
    return specs


def read_prices(path: Path | None, models: Sequence[ModelSpec]) -> dict[str, dict[str, float]]:
    """The price table (per million tokens) of each model; a model it does not list costs nothing."""
    if path is None:
        return {}
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--prices {path}: {exc}") from exc
    prices: dict[str, dict[str, float]] = {}
    for name, row in table.items():
        if not isinstance(row, dict):
            raise ValueError(f"--prices {path}: [{name!r}] must be a table of {', '.join(PRICE_KEYS)}")
        unknown = sorted(set(row) - set(PRICE_KEYS))
        if unknown:
            raise ValueError(f"--prices {path}: [{name!r}] has {unknown}; known keys are {', '.join(PRICE_KEYS)}")
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"--prices {path}: [{name!r}].{key} = {value!r}: a price of at least 0")
        prices[name] = {k: float(row.get(k, 0.0)) for k in PRICE_KEYS}
    named = {m.name for m in models}
    stray = sorted(set(prices) - named)
    if stray:
        raise ValueError(f"--prices {path}: prices for {stray}, which --models does not name ({sorted(named)})")
    return prices


def task_rewards(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each task's mean reward over its rollouts (rollouts without a reward left out), by the
    task's row: task ids derive from each eval's run id, so two models' evals name one task apart."""
    by_task: dict[str, list[float]] = {}
    for r in records:
        if r.get("reward") is not None:
            by_task.setdefault(json.dumps(r["task"], sort_keys=True), []).append(float(r["reward"]))
    return {task: sum(v) / len(v) for task, v in by_task.items()}


def paired(a: Mapping[str, float], b: Mapping[str, float], seed: int = 0) -> dict[str, Any]:
    """Model a minus model b over the tasks both have: mean difference, its standard error, and
    the two-sided p-value of a sign-flip permutation test of 'no difference'."""
    tasks = sorted(set(a) & set(b))
    diffs = [a[t] - b[t] for t in tasks]
    n = len(diffs)
    if n == 0:
        return {"num_tasks": 0, "mean_diff": None, "stderr": None, "p_value": None}
    mean = sum(diffs) / n
    stderr = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else None
    observed = abs(sum(diffs)) - 1e-12
    if n <= EXACT_UP_TO:
        signs: Any = itertools.product((1, -1), repeat=n)
        total = 2 ** n
    else:
        rng = random.Random(seed)
        signs = ([rng.choice((1, -1)) for _ in range(n)] for _ in range(NUM_DRAWS))
        total = NUM_DRAWS
    extreme = sum(1 for flip in signs if abs(sum(s * d for s, d in zip(flip, diffs, strict=True))) >= observed)
    return {"num_tasks": n, "mean_diff": mean, "stderr": stderr, "p_value": extreme / total}


def cost(summary: Mapping[str, Any], prices: Mapping[str, float] | None) -> float | None:
    if prices is None:
        return None
    return (summary["prompt_tokens"] * prices["prompt_per_mtok"]
            + summary["completion_tokens"] * prices["completion_per_mtok"]) / 1e6


def slug(text: str) -> str:
    return re.sub(r"[^-_.a-zA-Z0-9]+", "_", text)


async def compare(base: EvalConfig, models: Sequence[ModelSpec], prices: Mapping[str, Mapping[str, float]],
                  out_dir: Path, nats_url: str | None = None, serving: Serving | None = None,
                  settings: Settings | None = None) -> dict[str, Any]:
    """Evaluate each model as ``base`` says (its model, URL and results file replaced), then
    write the report beside the results: ``compare-ENV.md``, ``.json`` and ``.png``. ``serving``
    serves each model at ``base``'s URL (the local stack's inference: any model,
    :mod:`flywheel.ops.evalmodel`); ``settings``: whose workers and data dir load the environment."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, rewards = [], {}
    for spec in models:
        cfg = replace(base, model=spec.name, base_url=spec.base_url,
                      out=out_dir / f"{slug(base.env)}-{slug(spec.name)}.jsonl")
        summary = await run_eval(cfg, nats_url, serving=serving if spec.base_url == base.base_url else None,
                                 settings=settings)
        records = read_results(cfg.out)
        rewards[spec.name] = task_rewards(records)
        first_error = next((r["error"] for r in records if r.get("error")), None)
        rows.append({"model": spec.name, "base_url": spec.base_url, "results": str(cfg.out),
                     "cost": cost(summary, prices.get(spec.name)), "summary": summary, "first_error": first_error})
    pairs = [{"a": a.name, "b": b.name, **paired(rewards[a.name], rewards[b.name], base.seed)}
             for a, b in itertools.combinations(models, 2)]
    report: dict[str, Any] = {"env": base.env, "num_tasks": base.num_tasks, "num_rollouts": base.num_rollouts,
                              "seed": base.seed, "models": rows, "pairs": pairs}
    stem = out_dir / f"compare-{slug(base.env)}"
    report["markdown"] = str(stem.with_suffix(".md"))
    report["json"] = str(stem.with_suffix(".json"))
    report["png"] = str(stem.with_suffix(".png"))
    Path(report["markdown"]).write_text(markdown(report))
    Path(report["json"]).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(report["png"]))
    return report


def _num(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(report: Mapping[str, Any]) -> str:
    ks = [k for k in report["models"][0]["summary"] if k.startswith("pass@")]
    title = (f"# {report['env']}: {len(report['models'])} models on the same {report['num_tasks']} tasks "
             f"x {report['num_rollouts']} rollouts (seed {report['seed']})")
    lines = [title, "",
             "| model | reward ± stderr | " + " | ".join(ks) + " | prompt tokens | completion tokens | cost | errors |",
             "|---|---|" + "---|" * len(ks) + "---|---|---|---|"]
    for row in report["models"]:
        s = row["summary"]
        reward = f"{_num(s['reward_mean'])} ± {_num(s['reward_stderr'])}"
        lines.append(f"| {row['model']} | {reward} | " + " | ".join(_num(s[k]) for k in ks)
                     + f" | {s['prompt_tokens']} | {s['completion_tokens']} | {_num(row['cost'], 4)} | "
                       f"{s['num_errors']} |")
    failed = [row for row in report["models"] if row.get("first_error")]
    if failed:
        lines += ["", *(f"- {row['model']}: {row['summary']['num_errors']} rollouts failed; the first: "
                        f"{row['first_error']} (all in {row['results']})" for row in failed)]
    lines += ["", ("Paired over the tasks both models answered (per-task mean reward, a minus b; p: sign-flip "
                   "permutation test, two-sided):"), "",
              "| a | b | tasks | mean diff ± stderr | p |", "|---|---|---|---|---|"]
    for p in report["pairs"]:
        lines.append(f"| {p['a']} | {p['b']} | {p['num_tasks']} | {_num(p['mean_diff'])} ± {_num(p['stderr'])} | "
                     f"{_num(p['p_value'], 4)} |")
    return "\n".join(lines) + "\n"


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Reward mean per model with its standard error as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["model"] for row in report["models"]]
    means = [row["summary"]["reward_mean"] or 0.0 for row in report["models"]]
    errors = [row["summary"]["reward_stderr"] or 0.0 for row in report["models"]]
    # a bar's width in inches holds its name (run ids run to 30 characters and more)
    per_bar = max(1.4, 0.085 * max(len(name) for name in names))
    fig, ax = plt.subplots(figsize=(max(4.0, per_bar * len(names)), 3.2))
    ax.bar(names, means, yerr=errors, capsize=6, color="#4c72b0")
    ax.set_ylabel("reward (mean ± stderr)")
    ax.set_title(f"{report['env']}: {report['num_tasks']} tasks x {report['num_rollouts']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
