"""``flywheel optimize ENV --model M``: a better system prompt for a model whose weights stay put.

GEPA (the ``gepa`` package is the search engine) evolves the prompt by reflection: it runs the
current prompts on a minibatch of tasks, shows a reflection model the rollouts that scored badly
(the task, the answer, the reward and its parts, errors), takes the prompt it proposes, keeps it
when it does better on that minibatch, and keeps a Pareto set of prompts over a validation set.
Every evaluation is a ``flywheel eval`` of these rows (:class:`flywheel.runtime.evaluation.Evaluation`):
the environment's own harness and rewards, the prompt put in as every call's system message by
the recording proxy, whatever the harness sends. At the end the original prompt and the best
one are evaluated on held-out tasks that the search never saw; the report gives both rewards
with their standard errors.

Tasks: ``num_train`` for the minibatches, ``num_val`` for GEPA's validation set and
``num_test`` held out, drawn once (by ``seed``) without overlap.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import gepa
from gepa.core.adapter import EvaluationBatch

from flywheel.runtime.environments import WorkerEnvironment, WorkerPool
from flywheel.runtime.evalresults import mean_stderr, read_results
from flywheel.runtime.evaluation import EvalConfig, Evaluation
from flywheel.runtime.runs import load_environment
from flywheel.sdk.environment import EnvironmentOverrides
from flywheel.sdk.scoring import required_scorers

T = TypeVar("T")

PROMPT = "system_prompt"  # the one component GEPA evolves

REFLECTION_TEMPLATE = """You are improving the system prompt of an assistant.

The current system prompt:
```
<curr_param>
```

Here are tasks the assistant was given with this prompt, its answers, and how each was scored
(the reward, from 0 up to its best, with its parts and any error):
```
<side_info>
```

Write a new system prompt that makes the assistant score higher on tasks like these: say what
the task asks for and what a good answer looks like, generally, not for these tasks alone.
Answer with the new system prompt only, between ``` lines."""


@dataclass
class OptimizeConfig:
    eval: EvalConfig  # the environment, the model and its endpoint, sampling, rollouts per task
    num_train: int = 16
    num_val: int = 8
    num_test: int = 16
    max_metric_calls: int = 120  # rollouts the search may spend (GEPA's budget), held-out tests apart
    minibatch: int = 4
    reflection_model: str | None = None  # default: the model itself
    reflection_base_url: str | None = None  # default: the model's endpoint
    reflection_temperature: float | None = None  # default: the endpoint's


class Loop:
    """An event loop in a thread of its own, where the environment's workers live while GEPA (which
    is not async) asks for evaluations: :meth:`run` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="flywheel-optimize", daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class FlywheelAdapter:
    """GEPA's adapter: a candidate prompt is evaluated by ``flywheel eval`` on a batch of rows."""

    def __init__(self, cfg: OptimizeConfig, env: WorkerEnvironment, workdir: Path, loop: Loop) -> None:
        self.cfg = cfg
        self.env = env
        self.workdir = workdir
        self.loop = loop
        self.num_evals = 0
        self.propose_new_texts = None  # GEPA's own reflective proposer

    def run(self, rows: Sequence[dict[str, Any]], prompt: str, num_rollouts: int | None = None
            ) -> list[dict[str, Any]]:
        """The results records of ``rows`` with ``prompt`` as the system prompt (in task order)."""
        self.num_evals += 1
        base = self.cfg.eval
        cfg = replace(base, tasks=list(rows), num_tasks=len(rows), system_prompt=prompt, resume=False,
                      num_rollouts=num_rollouts or base.num_rollouts, record=False,
                      out=self.workdir / f"eval-{self.num_evals}.jsonl")
        self.loop.run(Evaluation(cfg, self.env).run())  # its progress line on stderr: the user sees what it waits on
        records = read_results(cfg.out)
        order = {json.dumps(row, sort_keys=True): i for i, row in enumerate(rows)}
        return sorted(records, key=lambda r: (order.get(json.dumps(r["task"], sort_keys=True), 0), r["index"]))

    def best(self) -> float:
        """The best reward there is (every reward at 1.0): GEPA's scores are rewards over it."""
        return sum(w for w in required_scorers(None, self.env).values() if w > 0) or 1.0

    def evaluate(self, batch: list[dict[str, Any]], candidate: dict[str, str], capture_traces: bool = False) -> Any:
        records = self.run(batch, candidate[PROMPT], num_rollouts=1)
        best = self.best()
        scores = [(r["reward"] or 0.0) / best for r in records]
        return EvaluationBatch(outputs=records, scores=scores, trajectories=records if capture_traces else None)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: Any, components_to_update: list[str]
                                ) -> dict[str, list[dict[str, Any]]]:
        rows = []
        for record in eval_batch.trajectories or []:
            asked = [m["content"] for m in record["messages"] if m["role"] == "user"]
            answered = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
            feedback = f"reward {record['reward']}" + (f", parts {record['rewards']}" if record["rewards"] else "")
            if record.get("error"):
                feedback += f"; error: {record['error']}"
            rows.append({"Inputs": asked[0] if asked else "", "Generated Outputs": answered[-1] if answered else "",
                         "Feedback": feedback})
        return {name: rows for name in components_to_update}


def reflection_lm(model: str, base_url: str, api_key: str | None, max_tokens: int = 512,
                  temperature: float | None = None) -> Any:
    """A callable GEPA asks for new prompts: one chat completion of ``model`` at ``base_url``
    (at ``temperature``; None: the endpoint's default)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=3)

    def ask(prompt: str | list[dict[str, Any]]) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        reply = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=max_tokens,  # the SDK's message union
                                               temperature=openai.omit if temperature is None else temperature)
        return reply.choices[0].message.content or ""

    return ask


def optimize(cfg: OptimizeConfig, out_dir: Path, pool: WorkerPool) -> dict[str, Any]:
    """Search for a better system prompt; returns (and writes to ``out_dir``) the report. The
    environment runs in ``pool``'s workers (closed at the end)."""
    loop = Loop()
    try:
        env = loop.run(load_environment(pool, cfg.eval.env, EnvironmentOverrides(args=dict(cfg.eval.env_args))))
        return _optimize(cfg, env, out_dir, loop)
    finally:
        loop.run(pool.close())
        loop.close()


def _optimize(cfg: OptimizeConfig, env: WorkerEnvironment, out_dir: Path, loop: Loop) -> dict[str, Any]:
    rows = loop.run(env.load_tasks(cfg.num_train + cfg.num_val + cfg.num_test, seed=cfg.eval.seed))
    unique = {json.dumps(r, sort_keys=True): r for r in rows}
    if len(unique) < cfg.num_train + cfg.num_val + cfg.num_test:
        raise ValueError(f"{cfg.eval.env}: {len(unique)} distinct tasks, fewer than --num-train + --num-val + "
                         f"--num-test = {cfg.num_train + cfg.num_val + cfg.num_test}: ask for fewer")
    train, val = rows[:cfg.num_train], rows[cfg.num_train:cfg.num_train + cfg.num_val]
    test = rows[cfg.num_train + cfg.num_val:]
    first = loop.run(env.prompt_messages(rows[0]))
    original = first[0].content if first and first[0].role == "system" else ""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        adapter = FlywheelAdapter(cfg, env, Path(scratch), loop)
        result: Any = gepa.optimize(
            seed_candidate={PROMPT: original}, trainset=train, valset=val, adapter=adapter,  # type: ignore[arg-type]
            reflection_lm=reflection_lm(cfg.reflection_model or cfg.eval.model,
                                        cfg.reflection_base_url or cfg.eval.base_url, cfg.eval.api_key,
                                        temperature=cfg.reflection_temperature),
            reflection_prompt_template=REFLECTION_TEMPLATE, reflection_minibatch_size=cfg.minibatch,
            max_metric_calls=cfg.max_metric_calls, seed=cfg.eval.seed, display_progress_bar=False,
            skip_perfect_score=False)  # adapter: GEPAAdapter's protocol, by its methods
        best_prompt = result.best_candidate[PROMPT]
        held_out = {name: adapter.run(test, prompt) for name, prompt in (("original", original), ("best", best_prompt))}
    errors = [r["error"] for records in held_out.values() for r in records if r.get("error")]
    if len(errors) == sum(map(len, held_out.values())):
        raise ValueError(f"every held-out rollout of {cfg.eval.model} at {cfg.eval.base_url} failed, so there is "
                         f"nothing to compare; the first: {errors[0]}")
    report: dict[str, Any] = {
        "env": cfg.eval.env, "model": cfg.eval.model, "original_prompt": original, "best_prompt": best_prompt,
        "num_candidates": len(result.candidates), "num_metric_calls": result.total_metric_calls,
        "num_train": len(train), "num_val": len(val), "num_test": len(test),
        "val_scores": list(result.val_aggregate_scores),
    }
    for name, records in held_out.items():
        mean, stderr = mean_stderr([r["reward"] or 0.0 for r in records])
        report[f"held_out_{name}"] = {"reward_mean": mean, "reward_stderr": stderr, "num_rollouts": len(records),
                                      "num_errors": sum(1 for r in records if r.get("error"))}
    report["held_out_gain"] = report["held_out_best"]["reward_mean"] - report["held_out_original"]["reward_mean"]
    path = out_dir / f"optimize-{cfg.eval.env.replace('/', '_')}-{cfg.eval.model.replace('/', '_')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    report["report"] = str(path)
    return report
