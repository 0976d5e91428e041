"""The summary of ``flywheel eval`` (:func:`flywheel.runtime.evalresults.summarize`): errors grouped by kind,
each with its count and an example, and every figure of the rewards over the rollouts without an
error (an errored rollout's rewards say nothing of the model)."""

from __future__ import annotations

from typing import Any

import pytest

from flywheel.ops.eval import format_summary
from flywheel.runtime.evalresults import error_kind, summarize

NOT_FOUND = ("harness failed: NotFoundError: Error code: 404 - {'error': {'message': \"model 'tiny': run 'tiny' is "
             "not in the runs bucket\"}}")


def record(task: str, index: int, reward: float | None, error: str | None = None,
           similarity: float = 0.5, reward_errors: dict[str, str] | None = None) -> dict[str, Any]:
    return {"task_id": task, "index": index, "rollout_id": f"{task}-{index}", "error": error,
            "status": "error" if error else "completed", "reward": reward,
            "rewards": {"similarity": similarity, "exact": float(similarity == 1.0)},
            "reward_errors": reward_errors or {}, "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


@pytest.mark.parametrize(("message", "kind"), [
    (NOT_FOUND, "harness failed: NotFoundError"),
    ("harness failed: APIConnectionError: Connection error.", "harness failed: APIConnectionError"),
    ("the harness ran past rollout_timeout_s=600.0", "the harness ran past rollout_timeout_s"),
    ("stopped: stale: sampled by weights version 3, version 5 is loaded", "stopped"),
    ("environment worker failed: its process exited with 9", "environment worker failed"),
    ("reward 'fails_on_q' failed: RuntimeError: cannot score q", "reward '...' failed: RuntimeError"),
    ("ValueError: bad row 12", "ValueError"),
    ("", "(no message)"),
])
def test_an_error_kind_is_the_messages_first_clause_with_its_exception_type(message: str, kind: str) -> None:
    assert error_kind(message) == kind


def test_errors_are_grouped_by_kind_with_a_count_and_an_example() -> None:
    timeout = "the harness ran past rollout_timeout_s=600.0"
    records = [record("t1", 0, None, NOT_FOUND), record("t1", 1, None, NOT_FOUND.replace("tiny", "other")),
               record("t2", 0, None, timeout), record("t2", 1, 1.0, similarity=1.0),
               record("t3", 0, None, reward_errors={"exact": "reward 'exact' failed: KeyError: 'answer'"})]
    summary = summarize(records, {"similarity": 1.0, "exact": 0.0}, 2, 1.0)
    assert summary["num_errors"] == 3 and summary["num_reward_errors"] == 1
    assert summary["errors"] == [
        {"where": "rollout", "kind": "harness failed: NotFoundError", "count": 2, "example": NOT_FOUND,
         "rollout_id": "t1-0"},
        {"where": "reward exact", "kind": "reward '...' failed: KeyError", "count": 1,
         "example": "reward 'exact' failed: KeyError: 'answer'", "rollout_id": "t3-0"},
        {"where": "rollout", "kind": "the harness ran past rollout_timeout_s", "count": 1, "example": timeout,
         "rollout_id": "t2-0"}]
    text = format_summary({**summary, "sampling": None})
    assert "errors by kind:" in text and "2 x rollout: harness failed: NotFoundError" in text
    assert "run 'tiny' is not in the runs bucket" in text  # the reason, on the screen, not only in the JSONL
    assert "over the 2 of 5 rollouts without an error (3 errored, left out)" in text


def test_every_figure_of_the_rewards_leaves_the_errored_rollouts_out() -> None:
    # Errored rollouts still get scored (their rewards compute on what the harness left): 0.9
    # here, which would lift every mean if counted.
    records = [record("t1", 0, None, NOT_FOUND, similarity=0.9), record("t1", 1, 0.2, similarity=0.2),
               record("t2", 0, None, NOT_FOUND, similarity=0.9), record("t2", 1, 0.4, similarity=0.4)]
    summary = summarize(records, {"similarity": 1.0, "exact": 0.0}, 2, 0.3)
    assert summary["num_rollouts"] == 4 and summary["num_scored"] == 2 and summary["num_errors"] == 2
    assert summary["reward_mean"] == pytest.approx(0.3) and summary["reward_stderr"] == pytest.approx(0.1)
    assert summary["rewards"]["similarity"]["mean"] == pytest.approx(0.3)
    assert summary["rewards"]["similarity"]["num"] == 2 and summary["rewards"]["exact"]["num"] == 2
    assert summary["pass@1"] == pytest.approx(0.5)  # t2's one scored rollout passes, t1's does not
    assert summary["pass@2"] is None  # no task has two rollouts without an error
    assert summary["num_tasks"] == 2 and summary["prompt_tokens"] == 12  # tokens: every rollout's


def test_an_eval_whose_every_rollout_errored_has_no_reward_and_names_why() -> None:
    records = [record("t1", i, None, NOT_FOUND, similarity=0.7) for i in range(4)]
    summary = summarize(records, {"similarity": 1.0}, 4, 1.0)
    assert summary["reward_mean"] is None and summary["rewards"]["similarity"] == {
        "mean": None, "stderr": None, "weight": 1.0, "num": 0}
    assert summary["pass@1"] is None and summary["num_errors"] == 4
    assert [(e["kind"], e["count"]) for e in summary["errors"]] == [("harness failed: NotFoundError", 4)]
