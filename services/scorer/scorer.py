"""The scorer: a rollout's rewards, run as functions and published as one Score per reward.

Two kinds of scorer process, one consumer loop (:class:`flywheel.bus.Consumer` in handler
mode, at most ``max_in_flight`` rollouts at once):

- the built-in scorer (durable ``scorer``, all of ``rollouts.>``): the rewards of each
  rollout's own environment (its ``REWARDS``, loaded once per environment);
- a custom scorer (durable ``scorer-<name>``, ``rollouts.*.<env>``): one user function,
  for one environment.

Processes with the same durable share its work: that is how scoring scales out.

Each reward gives one :class:`flywheel.events.Score` with id ``<rollout>.<scorer>``, so a
redelivered rollout scored again publishes the same ids, which JetStream (within its
duplicate window) and the readers (one score per rollout and scorer) keep once. The weight
is the run's own (``RunConfig.scorers`` in the run-state bucket) where its config names the
scorer, else the reward's default weight.

Failures, each where it belongs:

- a reward that raises, returns something other than a finite number, or runs past
  ``reward_timeout_s``: a Score with ``error`` saying so and value 0.0, recorded on that
  rollout (readers treat it as unusable, never as a zero); the rollout's other rewards are
  unaffected and the service goes on;
- an environment that does not load, or a run config whose ``scorers`` is not a map of
  names to numbers: the rollout is dead-lettered (:class:`flywheel.bus.Reject`) with the
  reason, as no retry can succeed;
- the bus failing (reading the run config, publishing): the error propagates and the bus
  layer retries the rollout with backoff.

Sync reward functions run in a thread pool, async ones on the event loop. Whether a function
is cheap cannot be known in advance (a judge model over HTTP, a regex over a long answer,
a test suite), and one blocking call on the loop stalls every rollout in flight with its
acks and ``in_progress`` signals. The hop to a thread costs about 0.1 ms a reward (two busy
cores), against a rollout that took a model generation; one process still scores about
2,300 reverse-text rollouts a second, publishing included. A CPU-bound reward holds the GIL
in its thread too: scale it with more processes on the same durable, not more threads.

Every rollout is scored whatever its status (an errored rollout gets scores too; the
trainer decides what it trains on). Not covered: group rewards (that see every rollout of a
group), and stopping a sync reward that never returns: the timeout reports it, but its
thread runs on and keeps the process from exiting until it returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from flywheel import events
from flywheel.bus import Bus, Consumer, Delivery, Reject
from flywheel.environment import Environment, EnvironmentLoadError, Reward, load_environment, make_reward
from flywheel.runs import get_run
from flywheel.service import Service
from flywheel.settings import Settings

log = logging.getLogger(__name__)

BUILTIN_DURABLE = "scorer"
# A scorer name is a NATS subject token (scores.<run>.<env>.<scorer>) and part of a durable name.
_NAME = re.compile(r"[-_A-Za-z0-9]{1,128}")

Publish = Callable[[Sequence[events.Event]], Awaitable[Any]]
Weights = Callable[[str], Awaitable[dict[str, float]]]


class RewardSource(Protocol):
    """What one scorer process scores with: its durable, its subjects, a rollout's rewards."""

    durable: str
    filter_subject: str | None

    def __call__(self, rollout: events.Rollout) -> dict[str, Reward]: ...


class EnvironmentRewards:
    """The built-in scorer: the rewards of each rollout's own environment."""

    durable = BUILTIN_DURABLE
    filter_subject: str | None = None

    def __init__(self) -> None:
        # Loaded on the loop's thread, once per environment: an import runs the module's
        # top-level code, which may assume the main thread (signal handlers, for one).
        self._envs: dict[str, Environment] = {}

    def __call__(self, rollout: events.Rollout) -> dict[str, Reward]:
        env = self._envs.get(rollout.env)
        if env is None:
            try:
                env = load_environment(rollout.env)
            except EnvironmentLoadError as exc:
                raise Reject(str(exc)) from exc
            except Exception as exc:  # the module's own code failed: no retry imports it better
                raise Reject(f"environment {rollout.env!r} failed to import: {type(exc).__name__}: {exc}") from exc
            self._envs[rollout.env] = env
        return env.rewards


class CustomReward:
    """A custom scorer: one user function, on the rollouts of one environment."""

    def __init__(self, env: str, reward: Reward) -> None:
        self.env = env
        self.reward = reward
        self.durable = f"scorer-{reward.name}"
        self.filter_subject: str | None = f"rollouts.*.{env}"

    def __call__(self, rollout: events.Rollout) -> dict[str, Reward]:
        return {self.reward.name: self.reward}


def load_function(spec: str) -> Callable[..., Any]:
    """``MODULE:FUNCTION`` -> the function; a ValueError names what to fix."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--function {spec!r}: write MODULE:FUNCTION, e.g. my_rewards:brevity")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"--function {spec!r}: cannot import {module_name!r} ({exc}); install it or put it "
                         "on PYTHONPATH") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--function {spec!r}: module {module_name!r} ({module.__file__}) has no function {attr!r}")
    return fn


def custom_reward(function: str, env: str, name: str | None = None, weight: float = 1.0) -> CustomReward:
    """The custom scorer of ``function`` for ``env``, checked before any rollout arrives."""
    fn = load_function(function)
    name = fn.__name__ if name is None else name
    if not _NAME.fullmatch(name):
        raise ValueError(f"--name {name!r}: use 1 to 128 letters, digits, '-' or '_' (it names the scorer in "
                         "subjects and its consumer)")
    if not _NAME.fullmatch(env):
        raise ValueError(f"--env {env!r}: use the environment's name as in its rollouts' subjects "
                         "(rollouts.<run>.<env>): letters, digits, '-' or '_'")
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"--weight {weight}: a weight is a finite number, not negative")
    try:
        environment = load_environment(env)
    except EnvironmentLoadError as exc:
        raise ValueError(f"--env {env!r}: {exc}") from exc
    if name in environment.rewards:
        raise ValueError(f"--name {name!r}: environment {env!r} has a reward of that name already (the built-in "
                         "scorer publishes it); give this scorer another name")
    return CustomReward(env, make_reward(name, fn, weight))


def configured_weights(state: events.RunState) -> dict[str, float]:
    """The run config's ``scorers`` (scorer name -> weight); empty: every reward's default."""
    try:
        return msgspec.convert(state.config.get("scorers", {}), dict[str, float])
    except msgspec.ValidationError as exc:
        raise Reject(f"run {state.id!r}: config.scorers must map scorer names to weights ({exc})") from exc


class RunWeights:
    """Each run's configured weights, read from the run-state bucket and kept ``ttl_s``.

    A run's config is written when the run is created, so one read per run every few seconds
    serves every rollout in between; a config written after a run's first rollouts takes
    effect within ``ttl_s``. A run without state in the bucket (tasks published straight to
    the bus) gets the rewards' default weights.
    """

    def __init__(self, bus: Bus, ttl_s: float = 5.0) -> None:
        self.bus = bus
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, dict[str, float]]] = {}  # run -> (when read, weights)

    async def __call__(self, run: str) -> dict[str, float]:
        now = time.monotonic()
        cached = self._cache.get(run)
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        try:
            state = await get_run(self.bus, run)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise Reject(f"run {run!r}: its run-state entry does not decode ({exc})") from exc
        weights = configured_weights(state) if state is not None else {}
        self._cache[run] = (now, weights)
        return weights


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _in_pool(pool: Executor, fn: Callable[..., Any], **kwargs: Any) -> asyncio.Future[Any]:
    return asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, **kwargs))


class Scorer:
    """Scores rollouts with the rewards of ``rewards`` and publishes the Scores."""

    def __init__(self, rewards: RewardSource, weights: Weights, publish: Publish, pool: Executor,
                 reward_timeout_s: float = 120.0) -> None:
        self.rewards = rewards
        self.weights = weights
        self.publish = publish
        self.pool = pool
        self.reward_timeout_s = reward_timeout_s
        self._traced: set[str] = set()  # rewards whose failure was logged with its traceback

    async def handle(self, delivery: Delivery) -> None:
        await self.publish(await self.score(delivery.event))

    async def score(self, rollout: events.Rollout) -> list[events.Score]:
        """One Score per reward, in the rewards' order; raises Reject for what can never be scored."""
        rewards = self.rewards(rollout)
        weights = await self.weights(rollout.run)
        return list(await asyncio.gather(*(self._score_one(rollout, reward, weights.get(name, reward.weight))
                                           for name, reward in rewards.items())))

    async def _score_one(self, rollout: events.Rollout, reward: Reward, weight: float) -> events.Score:
        value, error = 0.0, None
        runnable = reward if _is_async(reward.fn) else dataclasses.replace(
            reward, fn=functools.partial(_in_pool, self.pool, reward.fn))
        deadline = asyncio.timeout(self.reward_timeout_s)
        try:
            async with deadline:
                value = await runnable(rollout)
        except Exception as exc:
            if deadline.expired():
                error = f"reward {reward.name!r} timed out after {self.reward_timeout_s:g}s"
            else:
                error = f"reward {reward.name!r} failed: {type(exc).__name__}: {exc}"
            first = reward.name not in self._traced
            self._traced.add(reward.name)
            log.warning("rollout %s: %s", rollout.id, error, exc_info=exc if first else None)
        return events.Score(id=f"{rollout.id}.{reward.name}", run=rollout.run, env=rollout.env,
                            rollout_id=rollout.id, group_id=rollout.group_id, scorer=reward.name,
                            value=value, weight=weight, error=error)


@dataclass
class ScorerConfig:
    """Bounds of one scorer process."""

    max_in_flight: int = 64  # rollouts being scored at once (and unacked on the server)
    num_threads: int = 8  # threads for sync reward functions
    reward_timeout_s: float = 120.0
    run_config_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"reward_timeout_s must be positive, got {self.reward_timeout_s}")

    def build(self, bus: Bus, rewards: RewardSource, pool: Executor) -> Consumer:
        """The durable consumer of ROLLOUTS that scores with ``rewards``."""
        scorer = Scorer(rewards, RunWeights(bus, self.run_config_ttl_s), bus.publish_many, pool,
                        self.reward_timeout_s)
        return Consumer(bus, stream="ROLLOUTS", durable=rewards.durable, handler=scorer.handle,
                        event_type=events.Rollout, filter_subject=rewards.filter_subject,
                        max_in_flight=self.max_in_flight)


async def run(settings: Settings, rewards: RewardSource, config: ScorerConfig | None = None) -> None:
    """Composition root of a scorer process: connect, score until a signal, shut down."""
    config = config or ScorerConfig()
    bus = await Bus.connect(settings.resolved_nats_url, name=rewards.durable)
    service = Service(rewards.durable, bus, info={"subjects": rewards.filter_subject or "rollouts.>"})
    pool = ThreadPoolExecutor(config.num_threads, thread_name_prefix=rewards.durable)
    try:
        service.add(config.build(bus, rewards, pool))
        await service.run()  # finishes or hands back the rollouts in flight, then drains the bus
    finally:
        # Nothing is in flight any more, bar a reward thread past its timeout: not waited for.
        pool.shutdown(wait=False, cancel_futures=True)
