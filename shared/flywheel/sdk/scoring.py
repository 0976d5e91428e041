"""One scoring core: an environment's rewards run on rollouts, and what a rollout's reward is.

:class:`Scoring` runs rewards, metrics and group rewards by the same rules wherever they
run (the scorer service, ``flywheel eval``), so an environment scores the same in both:

- a reward runs once per rollout, a group reward once on the whole group, each under
  ``timeout_s``; sync functions run in an executor, so a slow one does not stall the loop,
  unless the reward says ``inline=True`` (microseconds, no I/O: it skips the thread hop; a
  call that holds the loop past :data:`INLINE_WARN_S` is logged, naming the reward, once);
- a reward that raises, returns something other than a finite number (or a dict of them),
  a group reward that returns a list of the wrong length, or one that runs past its
  timeout gives that rollout a :class:`flywheel.contract.events.Score` with ``error`` and
  value 0.0: never a silent zero, and the other rewards are unaffected.

The reward of a rollout is defined once, here, and every reader uses it: the trainer's join,
``flywheel eval``'s results and summary, and the trace store (which computes it in SQL,
tested against :func:`rollout_reward`). It is the weighted sum of the values of the run's
*required scorers* (:func:`required_scorers`: the run config's ``scorers``, else its
environment's rewards and metrics with the run's overrides), at their weights there; null
when the rollout is an error, or when a required scorer has not scored it yet or failed on
it. A score of any other scorer (a custom scorer outside ``scorers``) is recorded and counts
for nothing. Not covered: stopping a sync reward past its timeout (its thread runs on until
it returns; the rollout is scored as timed out all the same).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

from flywheel.contract import events

# The scorer's `reward_timeout_s` and eval's, unless set: one default for both, written in the settings.
from flywheel.contract.settings import REWARD_TIMEOUT_S
from flywheel.sdk.environment import GroupReward, Reward, Value, off_the_loop
from flywheel.sdk.sandbox import metered_to

log = logging.getLogger(__name__)

# An inline reward's call that holds the event loop longer than this is logged (once per reward).
INLINE_WARN_S = 0.01

if TYPE_CHECKING:
    from flywheel.contract.config import RunConfig


class Rewarded(Protocol):
    """What the reward's definition needs of an environment (an
    :class:`~flywheel.sdk.environment.Environment`, or one loaded in a worker): its rewards' weights."""

    @property
    def name(self) -> str: ...

    @property
    def weights(self) -> dict[str, float]: ...


class LoadedForRun(Protocol):
    """One environment of a run, as :func:`reward_definition` reads it."""

    @property
    def env(self) -> Rewarded: ...

Outcome = Value | str  # a reward's value on one rollout, or the error text
OnFailure = Callable[[str, str, Sequence[str], BaseException], None]  # (reward, error text, rollout ids, exception)


class Scoring:
    """Runs rewards under ``timeout_s``, sync functions in ``executor`` (None: asyncio's default).
    ``on_failure`` hears of every failure (the scorer service logs them)."""

    def __init__(self, executor: Executor | None = None, timeout_s: float = REWARD_TIMEOUT_S,
                 on_failure: OnFailure | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be positive, got {timeout_s}")
        self.executor = executor
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self._runnable: dict[int, tuple[Reward | GroupReward, Reward | GroupReward]] = {}  # id -> (reward, runnable)
        self._slow_inline: set[str] = set()  # inline rewards already logged as holding the loop

    def runnable(self, reward: Reward | GroupReward) -> Reward | GroupReward:
        """``reward`` itself when it is async, else a copy whose function runs in the executor (made once)."""
        found = self._runnable.get(id(reward))
        if found is None or found[0] is not reward:
            found = self._runnable[id(reward)] = (
                reward, off_the_loop(reward, self.executor))  # type: ignore[type-var]  # keeps the kind it is given
        return found[1]

    async def run(self, reward: Reward | GroupReward, rollouts: Sequence[events.Rollout]) -> list[Outcome]:
        """One outcome per rollout, in order: a reward runs on each rollout (each under its own
        timeout), a group reward once on all of them (an error is every rollout's)."""
        if isinstance(reward, GroupReward):
            outcome = await self._run(reward, list(rollouts), [r.id for r in rollouts])
            return list(outcome) if isinstance(outcome, list) else [outcome] * len(rollouts)
        if len(rollouts) == 1:  # the scorer's case: nothing to run beside it, so no task
            outcome = await self._run(reward, rollouts[0], [rollouts[0].id])
            return [outcome]  # type: ignore[list-item]  # a Reward on one rollout gives no list
        return list(await asyncio.gather(  # type: ignore[arg-type]  # a Reward on one rollout gives no list
            *(self._run(reward, r, [r.id]) for r in rollouts)))

    async def _run(self, reward: Reward | GroupReward, arg: events.Rollout | list[events.Rollout],
                   ids: list[str]) -> Value | list[Value] | str:
        kind = "group reward" if isinstance(reward, GroupReward) else "reward"
        deadline = asyncio.timeout(self.timeout_s)
        rollouts = arg if isinstance(arg, list) else [arg]
        try:
            # Sandboxes the reward makes are metered to the run (and the rollout, when it scores one).
            with metered_to(rollouts[0].run if rollouts else "", ids[0] if len(ids) == 1 else None):
                async with deadline:
                    if reward.inline:
                        return await self._inline(reward, arg)
                    return await self.runnable(reward)(arg)  # type: ignore[arg-type]  # a list only for a GroupReward
        except Exception as exc:
            if deadline.expired():
                error = f"{kind} {reward.name!r} timed out after {self.timeout_s:g}s"
            else:
                error = f"{kind} {reward.name!r} failed: {type(exc).__name__}: {exc}"
            if self.on_failure is not None:
                self.on_failure(reward.name, error, ids, exc)
            return error

    async def _inline(self, reward: Reward | GroupReward, arg: events.Rollout | list[events.Rollout]
                      ) -> Value | list[Value]:
        started = time.perf_counter()
        try:
            return await reward(arg)  # type: ignore[arg-type]  # a list only for a GroupReward
        finally:
            held = time.perf_counter() - started
            if held > INLINE_WARN_S and reward.name not in self._slow_inline:
                self._slow_inline.add(reward.name)
                log.warning("%s %r is inline=True but held the event loop %.0f ms on one call (more than %.0f ms): "
                            "other rollouts waited meanwhile; drop inline=True so it runs in a thread",
                            reward.KIND, reward.name, held * 1000, INLINE_WARN_S * 1000)

    async def scores(self, reward: Reward | GroupReward, rollouts: Sequence[events.Rollout],
                     weight: float) -> list[events.Score]:
        """``reward``'s Score on each rollout, at ``weight``."""
        outcomes = await self.run(reward, rollouts)
        return [score_event(r, reward.name, weight, o) for r, o in zip(rollouts, outcomes, strict=True)]

    async def score_group(self, rewards: Sequence[Reward | GroupReward], rollouts: Sequence[events.Rollout],
                          weights: Mapping[str, float] | None = None) -> list[list[events.Score]]:
        """Every reward (group rewards included) on a whole group: per rollout, one Score per
        reward in ``rewards``' order, each at its weight in ``weights`` (default: its own)."""
        weights = weights or {}
        by_reward = await asyncio.gather(*(self.scores(r, rollouts, weights.get(r.name, r.weight)) for r in rewards))
        return [[scores[i] for scores in by_reward] for i in range(len(rollouts))]


def score_event(rollout: events.Rollout, name: str, weight: float, outcome: Outcome,
                value: Value | None = None) -> events.Score:
    """The Score of ``name`` on ``rollout``: ``outcome`` is its value, or an error text (with
    ``value`` still recorded when there is one, e.g. a group scored incomplete). Its id is
    ``<rollout>.<name>``, so scoring a rollout again gives the same ids."""
    if isinstance(outcome, Value):
        value, error = outcome, None
    else:
        error = outcome
    return events.Score(id=f"{rollout.id}.{name}", run=rollout.run, env=rollout.env, rollout_id=rollout.id,
                        group_id=rollout.group_id, scorer=name, value=value.value if value else 0.0, weight=weight,
                        components=value.components if value else {}, error=error)


def required_scorers(config: RunConfig | None, env: Rewarded) -> dict[str, float]:
    """The scorers whose weighted values make a run's reward, name -> weight: the environment's
    rewards and metrics (``env`` loaded for the run, its overrides applied) with the run
    config's ``scorers`` added (one of theirs named there takes that weight), or only the
    config's ``scorers`` with ``replace_rewards``. Without a run config (``flywheel eval``):
    the environment's."""
    if config is None:
        return env.weights
    if config.replace_rewards:
        return dict(config.scorers)
    return env.weights | config.scorers


def reward_definition(config: RunConfig, environments: Mapping[str, LoadedForRun]
                      ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """A run's reward as its state records it (``RunState.scorers``, ``env_scorers``): for one
    environment, its :func:`required_scorers` and no per-environment table; for several, each
    one's (by its name in subjects) and, as ``scorers``, every scorer of theirs (the weight of
    the first environment that has it)."""
    by_env = {name: required_scorers(config, found.env) for name, found in environments.items()}
    if len(by_env) == 1:
        return next(iter(by_env.values())), {}
    every: dict[str, float] = {}
    for required in by_env.values():
        every = required | every
    return every, by_env


def describe_reward(required: Mapping[str, float], env: Rewarded) -> str:
    """``required`` (:func:`required_scorers`) as a person reads it: the weighted sum, the
    metrics (weight 0, recorded and required, not trained on), and which scorers are not the
    environment's (a custom scorer that must be running)."""
    own = set(env.weights)
    terms = [f"{weight:g} x {name}" for name, weight in required.items() if weight]
    text = "reward = " + (" + ".join(terms) if terms else "0 (every weight is 0)")
    metrics = [name for name, weight in required.items() if not weight]
    if metrics:
        text += f"; metrics (weight 0): {', '.join(metrics)}"
    custom = [name for name in required if name not in own]
    if custom:
        text += (f"; not {env.name}'s own, so a custom scorer must score them: {', '.join(custom)} "
                 "(flywheel scorer MODULE:FUNCTION --env ENV, named by --name or the function's name)")
    return text


def rollout_reward(status: str, scores: Iterable[events.Score], required: Mapping[str, float] | None) -> float | None:
    """A rollout's reward: the sum of weight x value over the ``required`` scorers (name ->
    weight, :func:`required_scorers`); None when ``status`` is ``error``, or a required scorer
    has no score among ``scores`` or its score has an error. Other scorers' scores count for
    nothing. ``required`` None or empty means the run's reward is not known (a run registered
    without it): then every score counts, at its own weight, and None before the first."""
    if status == "error":
        return None
    by_scorer = {s.scorer: s for s in scores}
    if not required:
        if not by_scorer or any(s.error is not None for s in by_scorer.values()):
            return None
        return sum(s.weight * s.value for s in by_scorer.values())
    total = 0.0
    for name, weight in required.items():
        found = by_scorer.get(name)
        if found is None or found.error is not None:
            return None
        total += weight * found.value
    return total
