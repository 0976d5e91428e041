"""The one rollout runner (:func:`flywheel.sdk.rollout.run_harness`): how a harness's end
becomes a rollout's status, error and state, the same for inference and ``flywheel eval``.

The endpoint is a hand-written stand-in for the caller's end of the URL (the interception
session, the recording proxy): it counts the calls the harness makes through it. That both
callers give the same outcomes is tests/integration/test_eval_training_parity.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from flywheel.sdk.environment import Environment
from flywheel.sdk.harness import RolloutContext
from flywheel.sdk.rollout import NO_MODEL_CALL, run_harness


@dataclass
class Endpoint:
    num_calls: int = 0
    truncated: bool = False
    ended: list[str] = field(default_factory=list)


@dataclass
class Harness:
    """Calls the "model" (counts a call on the endpoint), then does what the task says."""

    endpoint: Endpoint

    def initial_messages(self, env: Environment, task: dict[str, Any]) -> list[Any]:
        return []

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        ctx.state["seen"] = ctx.task["mode"]
        if ctx.task["mode"] != "silent":
            self.endpoint.num_calls += 1
        if ctx.task["mode"] == "raises":
            raise RuntimeError("the game server is down")
        if ctx.task["mode"] == "hangs":
            await asyncio.Event().wait()
        if ctx.task["mode"] == "unjson":
            ctx.state["board"] = object()
        if ctx.task["mode"] == "cut":
            ctx.state["truncated"] = True


def one() -> float:
    return 1.0


async def outcome_of(mode: str, truncated: bool = False) -> tuple[Any, Endpoint, list[str]]:
    endpoint = Endpoint(truncated=truncated)
    env = Environment(name="modes", tasks=[{"mode": mode}], rewards=[one], harness=Harness(endpoint),
                      prompt=lambda task: "go")
    closed: list[str] = []
    ctx = RolloutContext(task={"mode": mode}, base_url="http://unused/v1", api_key="k", model="m", rollout_id="ro1")

    async def release() -> None:
        closed.append("ctx")

    ctx.on_close(release)
    result = await run_harness(env, ctx, endpoint, timeout_s=0.2, on_end=lambda: endpoint.ended.append("end"))
    return result, endpoint, closed


@pytest.mark.parametrize(("mode", "truncated", "status", "error", "state"), [
    ("plays", False, "completed", None, {"seen": "plays"}),
    ("plays", True, "truncated", None, {"seen": "plays"}),  # the endpoint cut an answer
    ("cut", False, "truncated", None, {"seen": "cut", "truncated": True}),  # the harness says so
    ("raises", False, "error", "harness failed: RuntimeError: the game server is down", {"seen": "raises"}),
    ("hangs", False, "error", "the harness ran past rollout_timeout_s=0.2", {"seen": "hangs"}),
    ("silent", False, "error", NO_MODEL_CALL, {"seen": "silent"}),
    ("unjson", False, "error", "the harness's state is not JSON: Encoding objects of type object is unsupported", {}),
])
async def test_a_harness_end_becomes_status_error_and_state(mode: str, truncated: bool, status: str,
                                                            error: str | None, state: dict[str, Any]) -> None:
    result, endpoint, closed = await outcome_of(mode, truncated)
    assert (result.status, result.error, result.state) == (status, error, state)
    assert endpoint.ended == ["end"] and closed == ["ctx"]  # however it ended, the caller's end first
    assert 0 <= result.elapsed_s < 5
