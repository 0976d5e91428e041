"""The main job learns: ``flywheel run`` against a control run that cannot learn.

Two runs of the shipped example config, shortened, each through the real command (it
starts the embedded stack: nats-server, gateway, recorder, scorer, inference; then the
trainer): one with the example's learning rate, one with ``trainer.lr = 0``. Same model,
same SFT warm-up, same tasks. The learning run must end clearly above where it started,
by a margin the control does not reach. The control also checks token exactness over
every rollout it trained on: its weights never change after version 0, so the trainer's
recomputed logprobs must equal inference's (mean absolute difference at most 1e-3).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.contract.config import RunConfig
from flywheel.runtime.natsserver import free_port
from tests.e2e.test_up import Output, poll

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "reverse-text.toml"
NUM_STEPS = 150
# Reward points, mean of the last quarter of steps minus the first quarter. Runs are not seeded
# yet, so the gain varies from run to run: on two cores, 150 steps gained 0.056 in one run and
# more than 0.06 in four others; the controlled comparison below is the test's main claim.
MIN_GAIN = 0.05
MIN_MARGIN_OVER_CONTROL = 0.05


def flywheel_run(tmp_path: Path, name: str, *overrides: str, config: Path = CONFIG,
                 num_steps: int = NUM_STEPS, timeout_s: float = 900) -> tuple[dict, list[dict]]:
    data_dir = tmp_path / name
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(config), "--run-id", name, "--data-dir", str(data_dir),
            "--nats-port", str(free_port()), "--gateway-port", str(free_port()),
            "--inference-port", str(free_port()), "--set", f"trainer.num_steps={num_steps}"]
    for item in overrides:
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_dir = data_dir / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0  # version 0: the starting weights (after the SFT warm-up where there is one)
    if RunConfig.from_toml(config).sft.steps:
        assert lines[0]["sft_steps"] > 0
    metrics = lines[1:]
    assert (run_dir / "reward.png").stat().st_size > 1000
    return summary, metrics


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two runs of the main job; each subprocess has its own 900 s bound
def test_reward_rises_beyond_a_control_run_with_learning_rate_zero(tmp_path: Path) -> None:
    cfg = RunConfig.from_toml(CONFIG)
    learned, learned_metrics = flywheel_run(tmp_path, "learn")
    control, control_metrics = flywheel_run(tmp_path, "control", "trainer.lr=0")

    for summary, metrics in ((learned, learned_metrics), (control, control_metrics)):
        # The policy version advanced one step at a time to the end.
        assert summary["steps"] == NUM_STEPS
        assert [m["step"] for m in metrics] == list(range(1, NUM_STEPS + 1))
        assert [m["version"] for m in metrics] == list(range(1, NUM_STEPS + 1))
        # Staleness stayed within its bound, and nothing had to be dropped for it.
        assert max(m["staleness_max"] for m in metrics) <= cfg.trainer.max_off_policy_steps
        assert sum(m["num_rollouts"] for m in metrics) == NUM_STEPS * cfg.trainer.batch_size

    # Token exactness: with lr 0 every rollout was sampled by the weights that rescored it.
    assert max(m["logprob_diff_abs_mean"] for m in control_metrics) <= 1e-3

    print(f"reward gain: learning {learned['reward_gain']:.3f}, control {control['reward_gain']:.3f}")
    assert learned["reward_gain"] >= MIN_GAIN, learned
    assert learned["reward_gain"] >= control["reward_gain"] + MIN_MARGIN_OVER_CONTROL, (learned, control)



TWO_ENVS = ROOT / "examples" / "two-envs.toml"
SFT_STEPS = 100
MIN_SFT_GAIN = 0.1
TWO_ENV_STEPS = 200
# Each environment's last-quarter reward over its control's (both runs start from the same
# warm-up, whose level depends on the machine's floating-point sums: reverse-text 0.77-0.89).
# Measured margins at 200 steps: arithmetic 0.101, 0.112, 0.158; reverse-text 0.046, 0.106,
# 0.044, 0.024 and -0.013: on this tiny model RL gains little on reverse-text beside
# arithmetic, and one run's gain is within its noise. So: the mean margin is at least
# MIN_TWO_ENV_MARGIN (the run learns) and no environment falls more than MAX_TWO_ENV_LOSS
# below its control (none is given up for the other).
MIN_TWO_ENV_MARGIN = 0.03
MAX_TWO_ENV_LOSS = 0.03
EVAL_EVERY = 50


def detached_run(name: str, ports: dict[str, int], data_dir: Path, env: dict[str, str], *overrides: str,
                 evals: bool = True) -> Path:
    """``flywheel run`` of the two-environment example against ``flywheel up``, killed (SIGKILL) as
    soon as its orchestrator took the run: the run must finish by itself. Its run folder."""
    argv = [sys.executable, "-m", "flywheel.ops.cli", "run", str(TWO_ENVS), "--run-id", name, "--data-dir",
            str(data_dir), "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
            "--inference-port", str(ports["inference"]), "--set", f"trainer.num_steps={TWO_ENV_STEPS}"]
    overrides += (f"evals.0.every={EVAL_EVERY}", f"evals.1.every={EVAL_EVERY}") if evals else ("evals=[]",)
    for item in overrides:
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    output = Output(proc)
    output.wait_for(rf"^run {name}: published \d+ tasks", 120)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    summary = data_dir / "runs" / name / "summary.json"
    poll(summary.exists, 900, f"run {name} to finish by itself and its owner to write its summary")
    return summary.parent


@pytest.mark.slow
# Outside CI: two runs of 200 steps and an SFT job, a quarter hour of one of the two cores' worth of
# CI time; and its SFT part needs 100 reverse-text rollouts of reward 0.9 or more, which one run
# under load did not reach (2 of them), while its margins held.
@pytest.mark.outside_ci
@pytest.mark.timeout(1200)
def test_a_detached_run_on_two_environments_finishes_with_its_evals(
        stack: tuple[subprocess.Popen[str], Output, dict[str, int]], tmp_path: Path,
        clean_env: dict[str, str]) -> None:
    """The issue's acceptance run: the run finishes by itself after `flywheel run` is killed,
    every step trains both environments, every eval comes at its step, and the rewards (last
    quarter) end above an lr = 0 control's: on the mean of the two environments by
    MIN_TWO_ENV_MARGIN, neither below by more than MAX_TWO_ENV_LOSS (figures above them)."""
    _, output, ports = stack
    output.wait_for(r"^Flywheel is up", 120)
    data_dir = tmp_path / "data"  # the stack's: its orchestrator writes the run folders there
    run_dir = detached_run("mix", ports, data_dir, clean_env)
    control_dir = detached_run("mix-control", ports, data_dir, clean_env, "trainer.lr=0", evals=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    control = json.loads((control_dir / "summary.json").read_text())
    margins = {}
    for env in ("reverse_text", "arithmetic"):
        key = f"env.{env}.reward_last"
        margins[env] = summary[key] - control[key]
        print(f"{env}, last quarter: learning {summary[key]:.3f}, control {control[key]:.3f}")
    assert sum(margins.values()) / len(margins) >= MIN_TWO_ENV_MARGIN, (margins, summary, control)
    assert min(margins.values()) >= -MAX_TWO_ENV_LOSS, (margins, summary, control)
    assert not (control_dir / "evals.jsonl").exists()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["step"] for m in metrics] == list(range(1, TWO_ENV_STEPS + 1))
    shares = [sum(m[f"env.{env}.num_rollouts"] for m in metrics) for env in ("reverse_text", "arithmetic")]
    batch_size = RunConfig.from_toml(TWO_ENVS).trainer.batch_size
    # A rollout dropped alone (stale, errored) leaves its group's others to train: a step holds its
    # batch or a few fewer (measured: 99.4% of 200 full batches).
    assert 0.95 * TWO_ENV_STEPS * batch_size <= sum(shares) <= TWO_ENV_STEPS * batch_size, shares
    assert min(shares) >= 0.4 * sum(shares), shares  # weights 1 : 1
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert sorted((row["eval"], row["step"]) for row in evals) == sorted(
        (label, step) for label in ("arithmetic-medium", "reverse_text")
        for step in range(0, TWO_ENV_STEPS + 1, EVAL_EVERY)), evals
    assert {"env.reverse_text.reward_last", "env.arithmetic.reward_last", "eval.reverse_text.last"} <= set(summary)
    sft_on_the_runs_best_rollouts(ports, tmp_path, clean_env)


def greedy_reward(model_dir: Path | str, tasks: list[dict]) -> float:
    """reverse-text's mean reward of greedy answers (12 new tokens, as the runs sample) to ``tasks``."""
    import asyncio

    import torch

    from flywheel.contract import events
    from flywheel.sdk import models
    from flywheel.sdk.environment import Reward, load_environment
    from flywheel.sdk.tracegraph import rollout_from_messages

    env = load_environment("reverse_text")
    similarity = env.rewards[0]
    assert isinstance(similarity, Reward)
    model, tok = models.load_model(model_dir)
    rewards = []
    for task in tasks:
        messages = env.prompt_messages(task)
        prompt = torch.tensor([models.render_prompt(tok, messages)])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        answer = tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
        rollout = rollout_from_messages(run="eval", env="reverse_text", task_id="t", task_data=task, messages=[
            *messages, events.Message(role="assistant", content=answer)])
        rewards.append(asyncio.run(similarity(rollout)).value)
    return sum(rewards) / len(rewards)


def sft_on_the_runs_best_rollouts(ports: dict[str, int], tmp_path: Path, env: dict[str, str]) -> None:
    """The issue's SFT acceptance on the run above: its reverse-text rollouts of reward 0.9 and up,
    exported by the trace API with their tokens, fine-tune the tiny model it started from
    (`flywheel sft`), which then answers held-out tasks better, greedily."""
    import urllib.request

    from flywheel.sdk import models
    from flywheel.sdk.environment import load_environment

    url = (f"http://127.0.0.1:{ports['gateway']}/v1/rollouts/export?run=mix&env=reverse_text&min_reward=0.9"
           "&tokens=true")
    data = tmp_path / "best.jsonl"
    with urllib.request.urlopen(url, timeout=120) as response:
        data.write_bytes(response.read())
    *lines, end = data.read_text().splitlines()
    # Complete: its last line is the end line (a cut export's is an error line, or a rollout's).
    assert len(lines) >= 100 and json.loads(end) == {"end": {"num_rollouts": len(lines)}}, end[:300]
    sft_dir = tmp_path / "sft"
    done = subprocess.run([sys.executable, "-m", "flywheel.ops.cli", "sft", str(CONFIG), "--data", str(data),
                           "--run-id", "best", "--data-dir", str(sft_dir), "--set", f"sft.steps={SFT_STEPS}"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((sft_dir / "runs" / "best" / "summary.json").read_text())
    assert summary["examples"] == len(lines) and summary["loss_last"] < summary["loss_first"], summary
    exported = tmp_path / "best-model"
    subprocess.run([sys.executable, "-m", "flywheel.ops.cli", "export", "best", str(exported), "--data-dir",
                    str(sft_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, check=True)
    tasks = load_environment("reverse_text").load_tasks(32, seed=12345)
    before = greedy_reward(models.resolve_model("tiny", sft_dir), tasks)
    after = greedy_reward(exported, tasks)
    print(f"flywheel sft on {len(lines)} rollouts of reward >= 0.9: greedy reward {before:.3f} -> {after:.3f}")
    assert after >= before + MIN_SFT_GAIN, (before, after)


WORDLE_ECHO = ROOT / "examples" / "wordle-echo.toml"
ECHO_STEPS = 10
# The tiny model never writes a well-formed guess, so both runs' rewards are 0 here: the
# comparison guards against an echo term that breaks RL, not for a gain.
ECHO_REWARD_TOLERANCE = 0.02


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_echo_learns_the_environments_turns_on_a_multi_turn_game_without_costing_reward(tmp_path: Path) -> None:
    """Echo on wordle (the example config, shortened): RL on the guesses and cross-entropy on the
    game's answers in one step. The cross-entropy on the game's tokens falls as the model learns
    them (measured: 5.44 -> 3.66 over 10 steps of 16 rollouts), and the reward ends no lower than
    a control run's without the echo term."""
    echo, echo_metrics = flywheel_run(tmp_path, "echo", "trainer.batch_size=16", config=WORDLE_ECHO,
                                      num_steps=ECHO_STEPS)
    control, control_metrics = flywheel_run(tmp_path, "no-echo", "trainer.batch_size=16", "trainer.echo=0",
                                            config=WORDLE_ECHO, num_steps=ECHO_STEPS)
    assert [m["step"] for m in echo_metrics] == list(range(1, ECHO_STEPS + 1))
    assert all(m["num_env_tokens"] > 0 for m in echo_metrics)  # every step had the game's turns to learn
    assert not any("echo_loss" in m for m in control_metrics)
    print(f"echo loss {echo['echo_loss_first']:.3f} -> {echo['echo_loss_last']:.3f}; reward, last quarter: "
          f"echo {echo['reward_last']:.3f}, control {control['reward_last']:.3f}")
    assert echo["echo_loss_last"] <= 0.8 * echo["echo_loss_first"], echo
    assert echo["reward_last"] >= control["reward_last"] - ECHO_REWARD_TOLERANCE, (echo, control)

