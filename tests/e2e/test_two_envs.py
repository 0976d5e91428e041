"""A run on two environments with two evals through ``flywheel run`` against ``flywheel up``
(the real services): tasks of both, mixed by weight; each environment's rollouts scored with
its own rewards (the trainer's join and the trace store's reward alike); per-environment
metrics, summary and plot; one environment's SFT term in every step; the evals run on the
weights of steps 0 and the last, served as ``RUN@STEP``, recorded as eval runs linked to the
run, their weights let go afterwards.
Whether reward rises against an lr = 0 control is the slow tier's claim (tests/e2e/test_learning.py);
this one checks the plumbing, in a few steps."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_up import Output, nats_login

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "two-envs.toml"
NUM_STEPS = 4
READY_TIMEOUT_S = 120


@pytest.mark.long
def test_a_run_on_two_environments_mixes_scores_and_reports_each(
        tmp_path: Path, stack: tuple[subprocess.Popen[str], Output, dict[str, int]], clean_env: dict[str, str]) -> None:
    _, output, ports = stack
    output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    data_dir = tmp_path / "data"
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", "mix", "--data-dir",
            str(data_dir), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
            "--inference-port", str(ports["inference"]), "--set", f"trainer.num_steps={NUM_STEPS}",
            "--set", "sft.steps=10", "--set", "trainer.batch_size=64", "--set", "envs.0.weight=3",
            "--set", "evals.0.num_tasks=6",
            "--set", "evals.1.num_tasks=6",
            # arithmetic's own SFT term: 4 of its reference answers learned in every step
            "--set", "envs.1.sft_term.weight=0.5", "--set", "envs.1.sft_term.batch_size=4"]
    done = subprocess.run(argv, capture_output=True, text=True, env=clean_env, cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "run mix (reverse_text, weight 3): reward = 1 x similarity; metrics (weight 0): exact" in out, out
    assert "run mix (arithmetic, weight 1): reward = 1 x correct + 0.1 x shortest_correct" in out, out
    published = re.search(r"published (\d+) tasks of 8 rollouts each \(reverse_text (\d+), arithmetic (\d+)\)", out)
    assert published is not None, out
    total, reverse, arithmetic = (int(n) for n in published.groups())
    assert reverse + arithmetic == total and reverse == 3 * arithmetic  # 3 : 1, as the weights say
    # Each step names the environments its groups came from (which ones is the order they finished in:
    # the mix is the run's, below); a step with both is tests/unit/test_run_output.py's.
    step_line = r"^step +\d/4 +reward \S+ \(((?:reverse_text|arithmetic) \S+(?:, )?)+\).*  sft loss \d"
    steps = re.findall(step_line, out, re.M)
    assert len(steps) == NUM_STEPS, out
    assert re.search(r"^step +1/4 +reward .*  sft loss \d", out, re.M), out

    run_dir = data_dir / "runs" / "mix"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["step"] for m in metrics] == list(range(1, NUM_STEPS + 1))
    # A step takes the first groups done, whichever environment's: the mix is the run's, not each step's.
    totals = [0, 0]
    for m in metrics:
        counts = m["env.reverse_text.num_rollouts"], m["env.arithmetic.num_rollouts"]
        assert sum(counts) == m["num_rollouts"] == 64
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
        # Each environment's scores are over its own rollouts: arithmetic's metric is not
        # diluted by reverse_text's rollouts, which never get one.
        if counts[1]:
            assert 0.0 <= m["scores.formatted"] <= 1.0
        if counts[0]:
            assert "scores.similarity" in m
        assert m["sft_term_loss"] > 0 and m["num_sft_tokens"] >= 4  # the SFT term's rows, in every step
    assert totals[0] > 0 and totals[1] > 0, totals
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env"] == "reverse_text + arithmetic"
    assert {"env.reverse_text.reward_last", "env.arithmetic.reward_last"} <= set(summary)
    assert (run_dir / "reward.png").stat().st_size > 1000

    # The trace store rewards each rollout by its environment's scorers, as the trainer did.
    gateway = f"http://127.0.0.1:{ports['gateway']}"
    for env, own, other in (("reverse_text", "similarity", "correct"), ("arithmetic", "correct", "similarity")):
        page = httpx.get(f"{gateway}/v1/rollouts", params={"run": "mix", "env": env, "limit": 20}, timeout=10).json()
        assert page["items"], env
        for item in page["items"]:
            if item["status"] == "error":
                continue
            scores = {s["scorer"]: s["value"] for s in httpx.get(
                f"{gateway}/v1/rollouts/{item['id']}", timeout=10).json()["scores"]}
            assert own in scores and other not in scores, (env, scores)
            assert item["reward"] is not None, (env, item)

    # The evals: at step 0 and at the last step (every = 25 is past the end), one note each,
    # a line each in evals.jsonl, an eval run each in the trace store, linked to the run.
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert sorted((row["eval"], row["step"]) for row in evals) == [
        ("arithmetic-medium", 0), ("arithmetic-medium", 4), ("reverse_text", 0), ("reverse_text", 4)]
    for row in evals:
        assert row["num_rollouts"] == 6 and row["num_errors"] == 0 and row["reward_mean"] is not None, row
        assert re.search(rf"^run mix: eval {row['eval']} of step {row['step']}: reward [\d.]+ ± [\d.]+ over 6 "
                         rf"rollouts, 0 errors \(eval run mix-eval-{row['eval']}-{row['step']}\)$", out, re.M), out
        run = httpx.get(f"{gateway}/v1/runs/{row['run']}", timeout=10).json()
        assert run["kind"] == "eval", run
        rollouts = httpx.get(f"{gateway}/v1/rollouts", params={"run": row["run"]}, timeout=10).json()["items"]
        assert len(rollouts) == 6 and {r["reward"] is not None for r in rollouts} == {True}
    assert {"eval.arithmetic-medium.last", "eval.reverse_text.last"} <= set(summary)
    pinned, kept = asyncio.run(pins_and_versions(nats_login(data_dir, ports["nats"]), "mix"))
    assert pinned == [] and 0 not in kept  # step 0's weights let go once evaluated, and dropped


async def pins_and_versions(url: str, run: str) -> tuple[list[int], list[int]]:
    from flywheel.contract import weights
    from flywheel.contract.bus import Bus
    from flywheel.contract.runs import get_run

    bus = await Bus.connect(url, "test")
    try:
        state = await get_run(bus, run)
        assert state is not None
        assert state.env_ids == {"reverse_text": "reverse_text", "arithmetic": "arithmetic"}  # for the trace store
        return state.pinned_versions, await weights.versions(bus, run)
    finally:
        await bus.close()
