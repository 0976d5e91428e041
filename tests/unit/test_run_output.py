"""What `flywheel run` prints a step and at the end: drops by reason, metrics of weight 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.contract.config import RunConfig
from flywheel.runtime.reporting import Progress, format_dropped, format_step, summarize
from flywheel_trainer.join import Joiner
from flywheel_trainer.service import take_figures
from tests.unit.test_trainer_join import make_rollout, make_score


def test_the_step_line_counts_every_drop_by_reason_and_shows_the_metrics() -> None:
    row = {"step": 7.0, "elapsed_s": 12.0, "reward_mean": 0.5, "scores.exact": 0.25, "staleness_mean": 0.5,
           "staleness_max": 1.0, "num_dropped_stale": 1.0, "num_dropped_scorer_error": 2.0, "tokens_per_s": 900.0,
           "sampled_tokens_per_s": 250.0}
    line = format_step(row, 10, 16, metrics=["exact"])
    assert line.startswith("step   7/10  reward 0.500  exact 0.250  staleness 0.50 (max 1)  "
                           "dropped 3 (stale 1, scorer error 2)  tokens/s train 900 sample 250  ")
    assert line.endswith("in flight 16  t 12.0s")  # fractions of a second: early steps are sub-second
    assert format_dropped({"num_dropped_rollout_error": 1.0}) == "1 (rollout error 1)"
    assert format_dropped({}) == "0"
    # A run's added terms, each by its name: echo, the SFT term, dense distillation, a teacher's KL estimate.
    terms = format_step(row | {"echo_loss": 2.5, "sft_term_loss": 0.75, "distill_loss": 0.5,
                               "teacher.expert.kl": 1.25}, 10, None)
    assert "  echo loss 2.500  sft loss 0.750  distill loss 0.500  kl expert 1.250  staleness" in terms
    # A step of a run on several environments gives each one's reward, in the row's order.
    mixed = format_step(row | {"env.reverse_text.reward_mean": 0.25, "env.arithmetic.reward_mean": 0.75}, 10, None)
    assert mixed.startswith("step   7/10  reward 0.500 (reverse_text 0.250, arithmetic 0.750)  staleness")


def test_the_summary_has_drops_by_reason_and_each_metric_first_and_last(tmp_path: Path) -> None:
    progress = Progress()
    for step in range(8):
        progress.steps.append({"step": float(step), "elapsed_s": float(step), "reward_mean": 0.1 * step,
                               "scores.exact": 0.0 if step < 4 else 1.0, "num_dropped_scorer_error": 1.0,
                               "sft_term_loss": 2.0 - 0.2 * step})
    summary = summarize(progress, RunConfig(run="r", env="reverse_text"), tmp_path, metrics=["exact"])
    assert (summary["exact_first"], summary["exact_last"]) == (0.0, 1.0)
    assert (summary["sft_term_loss_first"], summary["sft_term_loss_last"]) == pytest.approx((1.9, 0.7))  # quarters
    assert (summary["num_dropped_stale"], summary["num_dropped_scorer_error"], summary["num_dropped_rollout_error"]) \
        == (0.0, 8.0, 0.0)


def test_a_steps_figures_hold_each_scorers_mean_metrics_included() -> None:
    joiner = Joiner({"similarity": 1.0, "exact": 0.0}, max_off_policy_steps=1)
    for rid, (similarity, exact) in {"a": (0.5, 0.0), "b": (1.0, 1.0)}.items():
        rollout = make_rollout(rid, "g")
        joiner.add_rollout(rollout)
        joiner.add_score(make_score(rollout, "similarity", similarity))
        joiner.add_score(make_score(rollout, "exact", exact))
    take = joiner.take(1)
    assert take is not None
    figures = take_figures(take, joiner)
    assert (figures["scores.similarity"], figures["scores.exact"], figures["reward_mean"]) == (0.75, 0.5, 0.75)
