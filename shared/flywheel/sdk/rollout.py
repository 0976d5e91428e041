"""One rollout of an environment's harness: the one runner behind training and ``flywheel eval``.

:func:`run_harness` runs ``env.harness`` on one task through a :class:`RolloutContext` and
says how it ended, by the same rules wherever it runs (the inference service in training,
:mod:`flywheel.runtime.evaluation` against any endpoint), so an environment runs the same in both:

- a harness that raises is an ``error`` rollout with ``harness failed: <type>: <message>``;
- one that runs past ``timeout_s`` is cancelled and is an ``error`` naming the timeout;
- one its caller stops (``stop``: inference stops a rollout that went stale) is cancelled
  and is an ``error`` with ``stopped: <reason>``;
- one that never called the model is an ``error`` (``the harness made no model call``): a
  rollout without an answer is nothing to score or train on;
- ``state`` must be JSON (it travels on the bus and reaches rewards): one that is not is
  an ``error`` saying why, with an empty state; nothing is converted to make it fit;
- otherwise ``truncated`` when an answer was cut at ``max_tokens`` (the endpoint saw a
  ``length`` finish) or the harness set ``state["truncated"]``, else ``completed``.

What differs between callers stays with them and is passed in: the base URL the context
points at (inference's interception session, eval's recording proxy) and an
:class:`Endpoint`, the caller's view of what that URL saw (calls answered, answers cut).
The caller builds the rollout event from the outcome with its own nodes and metrics.
Not covered: stopping a harness's threads (a sync call inside a harness past its timeout
runs on in its thread; the rollout is recorded as timed out all the same).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

# A harness gets this long unless told otherwise (setting inference.rollout_timeout_s, eval's
# `rollout_timeout_s`): one default for both, written in the settings.
from flywheel.contract.settings import ROLLOUT_TIMEOUT_S

if TYPE_CHECKING:
    from flywheel.sdk.environment import Environment
    from flywheel.sdk.harness import RolloutContext

log = logging.getLogger(__name__)
NO_MODEL_CALL = "the harness made no model call"

Status = Literal["completed", "truncated", "error"]


class Endpoint(Protocol):
    """What the caller's end of a rollout's base URL saw of the harness's model calls."""

    @property
    def num_calls(self) -> int:
        """Model calls answered."""
        ...

    @property
    def truncated(self) -> bool:
        """Whether an answer was cut at ``max_tokens`` (a ``length`` finish)."""
        ...


@dataclass(frozen=True)
class Outcome:
    """How one rollout's harness ended: status, error text (None unless ``error``), its state
    as JSON, and how long it ran."""

    status: Status
    error: str | None
    state: dict[str, Any]
    elapsed_s: float


def json_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as it travels (JSON types only); TypeError saying what does not fit otherwise."""
    try:
        return msgspec.json.decode(msgspec.json.encode(state))
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"the harness's state is not JSON: {exc}") from None


@dataclass(frozen=True)
class Ran:
    """What running a harness gave, before its endpoint is asked what it saw: the error (None:
    none), the state as JSON, whether the harness said it was cut short, how long it ran.
    An environment worker runs the harness and returns this; its host concludes the outcome."""

    error: str | None
    state: dict[str, Any]
    truncated: bool
    elapsed_s: float


async def run_harness(env: Environment, ctx: RolloutContext, endpoint: Endpoint, timeout_s: float = ROLLOUT_TIMEOUT_S,
                      on_end: Callable[[], Awaitable[None] | None] | None = None,
                      stop: asyncio.Future[str] | None = None) -> Outcome:
    """Run ``env``'s harness on ``ctx`` for at most ``timeout_s``, close ``ctx``, and say how it
    ended (see the module's rules). ``on_end`` runs when the harness has ended, however it
    ended, before ``ctx`` closes: the caller's end of the URL stops taking its calls there.
    ``stop``: when it gets a result (a reason) before the harness ends, the harness is
    cancelled and the rollout is an ``error`` with that reason (the caller knows it can no
    longer be used, e.g. it went stale)."""
    ran = await run_only(env, ctx, timeout_s, on_end, stop)
    return conclude(ran, endpoint, ctx.rollout_id, ctx.index)


async def run_only(env: Environment, ctx: RolloutContext, timeout_s: float = ROLLOUT_TIMEOUT_S,
                   on_end: Callable[[], Awaitable[None] | None] | None = None,
                   stop: asyncio.Future[str] | None = None) -> Ran:
    """:func:`run_harness` up to the endpoint's part: the harness run, ``ctx`` closed, the state checked."""
    assert env.harness is not None
    error: str | None = None
    started = time.monotonic()
    async def bounded() -> Any:  # asyncio.timeout, not wait_for: see flywheel.contract.bus.wait_at_most
        assert env.harness is not None
        async with asyncio.timeout(timeout_s):
            return await env.harness.run(env, ctx)

    harness = asyncio.ensure_future(bounded())
    try:
        if stop is not None:
            either: list[asyncio.Future[Any]] = [harness, stop]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not harness.done():
                harness.cancel()
                await asyncio.gather(harness, return_exceptions=True)
                error = f"stopped: {stop.result()}"
        if error is None:
            await harness
    except TimeoutError:
        error = f"the harness ran past rollout_timeout_s={timeout_s}"
    except Exception as exc:
        error = f"harness failed: {type(exc).__name__}: {exc}"
    finally:
        if not harness.done():  # this call was cancelled: so is the harness
            harness.cancel()
        try:
            if on_end is not None:
                ended = on_end()
                if ended is not None:
                    await ended
        finally:
            await ctx.close()
    elapsed_s = time.monotonic() - started
    try:
        state = json_state(ctx.state)
    except TypeError as exc:
        state, error = {}, str(exc) if error is None else f"{error}; {exc}"
    return Ran(error, state, bool(ctx.state.get("truncated")), elapsed_s)


def conclude(ran: Ran, endpoint: Endpoint, rollout_id: str = "", index: int = 0) -> Outcome:
    """The rollout's outcome from what the harness gave and what its endpoint saw (the module's rules)."""
    error = ran.error
    if error is None and endpoint.num_calls == 0:
        error = NO_MODEL_CALL
    if error is not None:
        log.info("rollout %s (index %d): %s", rollout_id or "?", index, error)
    truncated = endpoint.truncated or ran.truncated
    status: Status = "error" if error is not None else "truncated" if truncated else "completed"
    return Outcome(status, error, ran.state, ran.elapsed_s)
