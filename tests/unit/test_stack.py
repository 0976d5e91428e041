"""The supervisor's restart policy alone (the stack itself runs in tests/e2e/test_up_supervisor.py)."""

from __future__ import annotations

from flywheel.ops.stack import RestartBackoff


def test_restart_backoff_doubles_in_a_crash_loop_and_resets_after_a_healthy_stretch() -> None:
    backoff = RestartBackoff(first_delay_s=1.0, max_delay_s=8.0, healthy_after_s=30.0)
    assert [backoff.after_exit(healthy_for_s=2.0) for _ in range(7)] == [0, 1, 2, 4, 8, 8, 8]
    assert backoff.num_failures == 7 and backoff.delay_s == 8
    assert backoff.after_exit(healthy_for_s=30.0) == 0 and backoff.num_failures == 1
    assert backoff.after_exit(healthy_for_s=0.0) == 1
    assert RestartBackoff(max_delay_s=60.0).after_exit(0.0) == 0  # a first exit: at once
    many = RestartBackoff(max_delay_s=60.0, num_failures=5000)
    assert many.after_exit(0.0) == 60  # no overflow however long the loop
