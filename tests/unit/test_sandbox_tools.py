"""flywheel.sdk.sandbox_tools without a sandbox: the rollout context's releases, what the model reads
of a command, and how test verdicts are read (the service itself: tests/integration)."""

from __future__ import annotations

import logging

import pytest

from flywheel.sdk.harness import RolloutContext
from flywheel.sdk.sandbox import ExecResult
from flywheel.sdk.sandbox_tools import SandboxTools, command_verdicts, cut, describe, read_verdicts


async def test_releases_run_last_first_and_one_that_fails_stops_none(caplog: pytest.LogCaptureFixture) -> None:
    ctx = RolloutContext(task={}, base_url="", api_key="", model="", rollout_id="r-7")
    released: list[str] = []

    async def first() -> None:
        released.append("first")

    async def failing() -> None:
        raise ConnectionError("service gone")

    async def last() -> None:
        released.append("last")

    for release in (first, failing, last):
        ctx.on_close(release)
    with caplog.at_level(logging.WARNING, "flywheel.sdk.harness"):
        await ctx.close()
    assert released == ["last", "first"]
    assert "rollout r-7: releasing" in caplog.text and "ConnectionError: service gone" in caplog.text
    await ctx.close()  # each runs once
    assert released == ["last", "first"]


def test_cut_keeps_head_and_tail() -> None:
    assert cut("abc", 5) == ("abc", False)
    text, was_cut = cut("0123456789" * 3, 9)
    assert was_cut and text.startswith("012345\n[... 21 characters cut ...]\n") and text.endswith("789")


def test_what_the_model_reads_of_a_command() -> None:
    ok = ExecResult(exit_code=0, stdout="a\n", stderr="")
    assert describe(ok, 5, 100) == "exit code 0\n--- stdout ---\na"
    killed = ExecResult(exit_code=-9, stdout="", stderr="", stderr_truncated=False)
    assert describe(killed, 5, 100).startswith("killed by signal 9 (SIGKILL: the sandbox's memory or process limit")
    timed_out = ExecResult(exit_code=-9, stdout="x" * 50, stderr="", stdout_truncated=True, timed_out=True)
    assert describe(timed_out, 5, 100) == ("timed out after 5 s: the command and everything it started were killed\n"
                                           "--- stdout (more than 50 characters: showing 50 of the first 50) ---\n"
                                           + "x" * 50)
    with pytest.raises(ValueError, match=r"no tool \['ruby'\]; there are \['bash', 'python'\]"):
        SandboxTools().tools("ruby")
    assert [t.name for t in SandboxTools().tools()] == ["bash", "python"]


def test_verdicts_need_the_nonce_and_a_known_test() -> None:
    output = ("n1 pass test_a\nx pass test_b\nn1 fail test_b AssertionError: assert 1 == 2\n"
              "n1 pass test_b\nn1 pass test_unknown\n")
    verdicts, failures = read_verdicts(output, "n1", ["test_a", "test_b", "test_c"])
    assert verdicts == {"test_a": "pass", "test_b": "fail", "test_c": "missing"}  # the first verdict holds
    assert failures == {"test_b": "AssertionError: assert 1 == 2",
                        "test_c": "no verdict: the run ended before this test reported"}
    assert command_verdicts(ExecResult(exit_code=1, stdout="== 2 passed, 1 failed, 1 error in 3s ==", stderr="")) == {
        "passed_0": "pass", "passed_1": "pass", "failed_0": "fail", "failed_1": "fail"}
    assert command_verdicts(ExecResult(exit_code=-9, stdout="", stderr="", timed_out=True)) == {"command": "timeout"}
