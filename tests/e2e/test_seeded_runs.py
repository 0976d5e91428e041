"""Seeded runs reproduce: two synchronous runs of one seed train on the same rollouts.

Both runs go through ``flywheel run`` against one ``flywheel up`` stack (the real
services), one after the other, under different run ids: with ``seed`` set, the task
order, each rollout's sampling seed and the trainer's random state come from the seed, and
with ``trainer.max_off_policy_steps = 0`` each step's rollouts are sampled by the weights
of the step before, so nothing depends on timing but the batches inference happens to
form. A different batch changes the float rounding of the logits (the last bits of the
logprobs), not, in practice, a sampled token: the rewards must be equal step for step,
and the logprobs close. A third run with another seed must differ, so the test would see
a seed that changed nothing. The first run's metered usage (``GET /v1/usage``) must equal,
token for token, a recount from its stored traces, and its trained tokens the trainer's own
figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_up import Output

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "reverse-text.toml"
NUM_STEPS = 10
READY_TIMEOUT_S = 120


def seeded_run(run: str, seed: int, data_dir: Path, ports: dict[str, int], env: dict[str, str]) -> list[dict]:
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(CONFIG), "--run-id", run, "--data-dir", str(data_dir),
            "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
            "--inference-port", str(ports["inference"]), "--set", f"seed={seed}",
            "--set", f"trainer.num_steps={NUM_STEPS}", "--set", "trainer.max_off_policy_steps=0",
            "--set", "sft.steps=20"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = [json.loads(line) for line in (data_dir / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["step"] > 0]


def metered(gateway: str, run: str, steps: list[dict], timeout_s: float = 60.0) -> dict:
    """The run's usage report once the recorder has stored everything its steps trained (the
    recorder catches up after the run's end): the metered rollouts' tokens equal the recount
    from the stored traces, and the trained tokens the trainer's figures."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = httpx.get(f"{gateway}/v1/usage", params={"run": run, "recount": "true"}, timeout=10).json()
        trained = sum(item["trained_tokens"] for item in report["items"] if item["source"] == "trainer")
        if report["recount"]["matches"] and trained == sum(m["num_loss_tokens"] for m in steps):
            return report
        assert time.monotonic() < deadline, report
        time.sleep(1)  # noqa: sleep - the interval of a poll bounded by timeout_s (the recorder catching up)


@pytest.mark.slow  # two runs of 10 steps, a minute on two cores: the slow tier
def test_two_runs_of_one_seed_give_the_same_rewards(
        tmp_path: Path, stack: tuple[subprocess.Popen[str], Output, dict[str, int]], clean_env: dict[str, str]) -> None:
    _, output, ports = stack
    output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    data_dir = tmp_path / "data"
    first = seeded_run("seeded-a", 7, data_dir, ports, clean_env)
    second = seeded_run("seeded-b", 7, data_dir, ports, clean_env)
    other = seeded_run("seeded-c", 8, data_dir, ports, clean_env)

    assert [m["step"] for m in first] == list(range(1, NUM_STEPS + 1))
    rewards = [m["reward_mean"] for m in first]
    assert [m["reward_mean"] for m in second] == rewards
    assert [m["scores.exact"] for m in second] == [m["scores.exact"] for m in first]
    assert [m["num_loss_tokens"] for m in second] == [m["num_loss_tokens"] for m in first]
    for a, b in zip(first, second, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        assert a["staleness_max"] == b["staleness_max"] == 0
    assert [m["reward_mean"] for m in other] != rewards

    # Metering: every rollout's model calls and every step's trained tokens, recounted from the trace store.
    report = metered(f"http://127.0.0.1:{ports['gateway']}", "seeded-a", first)
    sources = {item["source"]: item for item in report["items"]}
    assert {"rollout", "trainer", "sft"} <= set(sources), report
    assert sources["trainer"]["num_counts"] == NUM_STEPS and sources["sft"]["sft_tokens"] > 0
    recount = report["recount"]
    assert recount["trained_tokens"] == sum(m["num_loss_tokens"] for m in first)
    assert (sources["rollout"]["num_calls"], sources["rollout"]["prompt_tokens"],
            sources["rollout"]["sampled_tokens"]) == (recount["num_calls"], recount["prompt_tokens"],
                                                      recount["sampled_tokens"])
    assert recount["sampled_tokens"] >= recount["trained_tokens"] > 0

    # The trainer's last checkpoint exports as a model transformers loads (tests/integration/test_export.py
    # checks the logprobs).
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "flywheel.ops.cli", "export", "seeded-a", str(out), "--data-dir",
                           str(data_dir)], capture_output=True, text=True, env=clean_env, cwd=ROOT, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "flywheel-export.json").read_text())["step"] == NUM_STEPS
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
