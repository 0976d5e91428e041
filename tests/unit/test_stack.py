"""The supervisor's restart policy alone (the stack itself runs in tests/e2e/test_up_supervisor.py)."""

from __future__ import annotations

from flywheel.contract.settings import Settings
from flywheel.ops.stack import RestartBackoff, metrics_port


def test_restart_backoff_doubles_in_a_crash_loop_and_resets_after_a_healthy_stretch() -> None:
    backoff = RestartBackoff(first_delay_s=1.0, max_delay_s=8.0, healthy_after_s=30.0)
    assert [backoff.after_exit(healthy_for_s=2.0) for _ in range(7)] == [0, 1, 2, 4, 8, 8, 8]
    assert backoff.num_failures == 7 and backoff.delay_s == 8
    assert backoff.after_exit(healthy_for_s=30.0) == 0 and backoff.num_failures == 1
    assert backoff.after_exit(healthy_for_s=0.0) == 1
    assert RestartBackoff(max_delay_s=60.0).after_exit(0.0) == 0  # a first exit: at once
    many = RestartBackoff(max_delay_s=60.0, num_failures=5000)
    assert many.after_exit(0.0) == 60  # no overflow however long the loop


def test_each_service_of_a_stack_serves_its_figures_on_its_own_port() -> None:
    assert [metrics_port(Settings(metrics_port=9464), i) for i in range(3)] == [
        {"FLYWHEEL_METRICS_PORT": str(9464 + i)} for i in range(3)]
    assert metrics_port(Settings(metrics_port=0), 4) == {"FLYWHEEL_METRICS_PORT": "0"}  # each a free one
    assert metrics_port(Settings(), 4) == {}  # not served

