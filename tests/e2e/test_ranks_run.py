"""A run trains end to end on two data-parallel trainer ranks.

``flywheel run`` with the setting ``trainer.ranks = 2`` (``FLYWHEEL_TRAINER__RANKS``): the
run's owner starts the trainer under torch's launcher, rank 0 consumes the bus and publishes
weights, rank 1 follows it through the warm-up, every step and every checkpoint, and stops
when rank 0 says so at the run's end (its log says each). The equivalence of a step on two
ranks and on one is ``tests/integration/test_trainer_ranks.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_learning import flywheel_run

NUM_STEPS = 8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_trains_on_two_trainer_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TRAINER__RANKS", "2")
    _, metrics = flywheel_run(tmp_path, "ranks", "sft.steps=20", "trainer.checkpoint_every=3",
                                    num_steps=NUM_STEPS)
    assert [m["step"] for m in metrics] == list(range(1, NUM_STEPS + 1))
    assert all(m["num_loss_tokens"] > 0 and m["grad_norm"] > 0 for m in metrics)
    log = (tmp_path / "ranks" / "runs" / "ranks" / "trainer.log").read_text()
    assert "trainer rank 1 of 2: following rank 0" in log, log[-3000:]
    assert "trainer rank 1: stopped by rank 0" in log, log[-3000:]
