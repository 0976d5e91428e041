"""The scorer: a rollout's rewards, run as functions and published as one Score per reward.

The functions are environment code, so they never run here: they run in the environment's
workers (:mod:`flywheel.runtime.environments`: sandboxed processes of the run's tenant, with
no credential), which this process starts and asks; a worker that dies fails the rewards it
was running, each with an error saying so, and the next rollout gets a new worker.

Two kinds of scorer process, one consumer loop (:class:`flywheel.contract.bus.Consumer` in handler
mode):

- the built-in scorer (durable ``scorer``, every rollout): the rewards and metrics of
  each rollout's environment, as its run loads it (:func:`flywheel.runtime.runs.load_for_run`:
  the environment of the run config, ``env`` or the ``[[envs]]`` table named by the rollout,
  with its args and reward overrides), or by the
  subject's environment name for a run without a config (tasks published straight to the bus);
- a custom scorer (durable ``scorer-<name>``, ``rollouts.*.<env>.*``): one user function,
  for one environment.

Processes of one scorer (its replicas) share its work by partitions: a rollout's subject ends in
its group's partition, every member of a group in the same one, and each partition is consumed
by one replica at a time (durable ``<durable>-p<k>``; :mod:`flywheel_scorer.partitions` splits
them over the live replicas and hands them on when one joins or dies). That is how scoring,
group rewards included, scales out.
Rollouts of an eval run (``RunState.kind == "eval"``, from ``flywheel eval --record``) come
with their own scores: they are acked, not scored again.

Each reward gives one :class:`flywheel.contract.events.Score` with id ``<rollout>.<scorer>`` (its
value, and its components when the function returned a dict), so a redelivered rollout
scored again publishes the same ids, which JetStream (within its duplicate window) and the
readers (one score per rollout and scorer) keep once. The rollouts of one batch message (a
group, as inference publishes it) publish their Scores as one batch message, in the
message's order, once each is scored: delivered again, the message gives the same batch
with the same id (``_Message``). Metrics (weight 0) are scored like
rewards. The weight is the run config's ``scorers`` entry where it names the scorer, else
the reward's weight in the run's environment (overrides applied).

Group rewards (:class:`flywheel.sdk.environment.GroupReward`) see every rollout of a group
(``Rollout.group_id``, ``group_size``, ``index``). A rollout's own rewards are published as
soon as it is scored (with its message's siblings); its delivery is then *held* (unacked,
kept alive with ``in_progress``, so it is not redelivered) until the rest of its group is
here. The arrival that completes the group runs the group rewards once and publishes one
Score per rollout; then every held delivery of the group is acked. Bounds, so holding can
never deadlock the consumer:

- the consumer lets ``max_in_flight + max_held`` rollouts be unacked (server side too), and
  scoring itself runs at most ``max_in_flight`` rollouts at once;
- at most ``max_held`` rollouts wait for their groups: when one more would wait, the oldest
  incomplete group is scored at once with what arrived, so slots for scoring always remain;
- a group incomplete after ``group_timeout_s`` is scored with what arrived.

These bounds are the settings' ``scorer`` section (:class:`flywheel.contract.settings.ScorerSettings`:
``FLYWHEEL_SCORER__MAX_HELD``, ``[scorer]`` in the settings file); the command's options win.

A group scored incomplete gets, on every rollout that arrived, a group-reward Score with its
value and ``error`` naming the missing indices and why (readers treat a score with an error
as unusable, so the trainer drops those rollouts rather than train on a partial group). A
member that arrives after its group was scored gets a Score with ``error`` saying so.

When a partition goes to another replica, the members of its groups held here are handed back
at once (nak) and redelivered to the new owner, where the group forms again whole; a member
still being scored here when its partition goes is handed back as it joins its group.

Failures, each where it belongs:

- a reward that raises, returns something other than a finite number (or, for a group
  reward, a list of the wrong length), or runs past ``reward_timeout_s``, or whose worker
  dies: a Score with ``error`` saying so and value 0.0, recorded on that rollout (readers
  treat it as unusable, never as a zero); the rollout's other rewards are unaffected and the
  service goes on (:class:`flywheel.sdk.scoring.Scoring` runs rewards by these rules in the
  worker, as it does for ``flywheel eval``);
- an environment that does not load, or a run config that does not parse: the rollout is
  dead-lettered (:class:`flywheel.contract.bus.Reject`) with the reason, as no retry can succeed;
- the bus failing (reading the run config, publishing): the error propagates and the bus
  layer retries the rollout with backoff (a held group member too; the group forms again).

In the worker, sync reward functions run in a thread pool, async ones on its event loop, so
a slow one does not stall the others; a rollout's per-rollout rewards go to the worker in one
call, a group's group rewards in another. A CPU-bound reward holds its worker's GIL: the
environment gets another worker when one is busy (setting ``workers.max_per_environment``),
and more scorer processes on the same durable scale it further.

Every rollout is scored whatever its status (an errored rollout gets scores too; the
trainer decides what it trains on). Not covered: remembering scored groups across a restart
(a late member after a restart forms a new group and is scored incomplete after the timeout).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import msgspec
from opentelemetry import trace

from flywheel.contract import events, metrics
from flywheel.contract.bus import MAX_DELIVER, Bus, Consumer, Delivery, HandBack, Reject
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import end_of, get_run, list_runs, scorers_of
from flywheel.contract.service import Service
from flywheel.contract.settings import ScorerSettings, Settings
from flywheel.runtime.environments import WorkerEnvironment, WorkerError, WorkerPool
from flywheel.runtime.envworker import LoadSpec, RewardOutcome
from flywheel.runtime.runs import load_environment, load_for_run
from flywheel.sdk.environment import EnvironmentLoadError, Value, completion_of
from flywheel.sdk.hooks import FLAG_METRIC, hook_flags
from flywheel.sdk.sandbox import SandboxClient
from flywheel.sdk.scoring import score_event
from flywheel_scorer.partitions import HANDBACK_ALLOWANCE, Partitions, partition_filter
from flywheel_scorer.watch import Watch, flag_score

log = logging.getLogger(__name__)

BUILTIN_DURABLE = "scorer"
# A scorer name is a NATS subject token (scores.<run>.<env>.<scorer>) and part of a durable name.
_NAME = re.compile(r"[-_A-Za-z0-9]{1,128}")
# Groups already scored, remembered so a late member is told so (not scored as a new group).
_NUM_CLOSED_GROUPS = 10_000

Publish = Callable[[Sequence[events.Event]], Awaitable[Any]]


@dataclass(frozen=True)
class RewardSet:
    """What one rollout is scored with: the environment (in its workers) whose rewards they are,
    the names of its per-rollout rewards (metrics included) and group rewards, each one's own weight."""

    env: WorkerEnvironment | None = None
    rewards: list[str] = field(default_factory=list)
    group_rewards: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, env: WorkerEnvironment) -> RewardSet:
        return cls(env, env.info.rollout_rewards, env.info.group_rewards, env.weights)


@dataclass(frozen=True)
class RunInfo:
    """What a scorer needs of a rollout's run: its config (None: registered without one) and tenant."""

    config: RunConfig | None
    tenant: str = ""


class RewardSource(Protocol):
    """What one scorer process scores with: its durable, its subjects, a rollout's rewards."""

    durable: str
    filter_subject: str | list[str] | None

    async def start(self, bus: Bus, pool: WorkerPool) -> datetime | None:
        """Get ready to score with ``pool``'s workers (a custom scorer loads its function now: a
        mistake is a ValueError naming the option); where a new durable starts in the stream
        (None: its first rollout)."""
        ...

    def joined(self, created: bool | None, start: datetime | None) -> str | None:
        """Its consumer is bound (``created``: its durable is new): what it scores, to say at start."""
        ...

    async def __call__(self, rollout: events.Rollout, run: RunInfo) -> RewardSet: ...


class EnvironmentRewards:
    """The built-in scorer: the rewards of each rollout's environment, as its run loads it."""

    durable = BUILTIN_DURABLE
    filter_subject: str | list[str] | None = None

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None
        # Loaded once per run (its overrides are its own) or per environment name (runs without a config).
        self._by_run: dict[tuple[str, str], RewardSet] = {}
        self._by_env: dict[tuple[str, str], RewardSet] = {}

    async def start(self, bus: Bus, pool: WorkerPool) -> datetime | None:
        self.pool = pool
        return None  # every rollout of every run needs its environment's rewards

    def joined(self, created: bool | None, start: datetime | None) -> str | None:
        return None

    async def __call__(self, rollout: events.Rollout, run: RunInfo) -> RewardSet:
        assert self.pool is not None, "start() first"
        config = run.config
        cache = self._by_run if config is not None else self._by_env
        key = (rollout.run if config is not None else run.tenant, rollout.env)
        found = cache.get(key)
        if found is None:
            try:
                env = (await load_for_run(self.pool, config, rollout.env, run.tenant) if config is not None
                       else await load_environment(self.pool, rollout.env, tenant=run.tenant))
            except (EnvironmentLoadError, ValueError) as exc:  # no retry loads it better: dead-lettered, saying why
                raise Reject(str(exc)) from exc
            found = cache[key] = RewardSet.of(env)
        return found


class CustomReward:
    """A custom scorer: one user function (a reward, or a group reward), on the rollouts of one environment.

    Where it starts, when its durable is new: ``runs`` named, every rollout of those runs;
    ``backfill``, every stored rollout of the environment; else from now on, and from the
    start of each run still going whose reward names it (so that run's earlier rollouts get
    their score too: the durable starts at the earliest such run, and rollouts of other runs
    made before now are passed over). A durable that exists goes on where it stopped.
    """

    def __init__(self, function: str, env: str, name: str | None = None, weight: float = 1.0, group: bool = False,
                 runs: Sequence[str] = (), backfill: bool = False) -> None:
        self.function, self.env, self.weight, self.group = function, env, weight, group
        self.name = name or function.rpartition(":")[2]
        self.runs = tuple(runs)
        self.backfill = backfill
        self.durable = f"scorer-{self.name}"
        self.filter_subject: str | list[str] | None = (
            [f"rollouts.{run}.{env}" for run in self.runs] if self.runs else f"rollouts.*.{env}")
        self._set = RewardSet()
        # Joining from now: rollouts made before this, of runs not in _needing, are passed over.
        self._joined_at: datetime | None = None
        self._needing: set[str] = set()

    async def start(self, bus: Bus, pool: WorkerPool) -> datetime | None:
        await self.load(pool)
        if self.runs or self.backfill:
            return None
        needing = [s for s in await list_runs(bus) if self.name in scorers_of(s, self.env) and end_of(s) is None]
        self._joined_at, self._needing = events.utc_now(), {s.id for s in needing}
        return min([self._joined_at, *(s.created_at for s in needing)])

    async def load(self, pool: WorkerPool) -> None:
        """Its function and its environment, loaded in workers and checked; a ValueError names the option."""
        try:
            loaded = await pool.load(LoadSpec(function=self.function, name=self.name, weight=self.weight,
                                              group=self.group))
        except EnvironmentLoadError as exc:
            raise ValueError(f"--function {self.function!r}: {exc}; install the module or put it on PYTHONPATH"
                             ) from None
        try:
            environment = await load_environment(pool, self.env)
        except EnvironmentLoadError as exc:
            raise ValueError(f"--env {self.env!r}: {exc}") from exc
        if self.name in environment.weights:
            raise ValueError(f"--name {self.name!r}: environment {self.env!r} has a reward of that name already (the "
                             "built-in scorer publishes it); give this scorer another name")
        self._set = RewardSet.of(loaded)

    def joined(self, created: bool | None, start: datetime | None) -> str:
        if not created:  # the durable goes on where it stopped: everything it is given is new to it
            self._joined_at = None
        what = f"{self.durable} scores {self.name!r} on {self.filter_subject}"
        if not created:
            return f"{what}: its durable exists, so it goes on where it stopped"
        if self.runs:
            return f"{what}: every rollout of run(s) {', '.join(self.runs)}"
        if start is None:
            return f"{what}: every stored rollout of {self.env} (--backfill), then new ones"
        return (f"{what}: rollouts from {start.isoformat(timespec='seconds')} on (now, or the start of a run still "
                "going whose reward names it); --backfill scores the stored history, --run RUN a run's rollouts")

    async def __call__(self, rollout: events.Rollout, run: RunInfo) -> RewardSet:
        if self._joined_at is not None and rollout.created_at < self._joined_at and rollout.run not in self._needing:
            return RewardSet()  # from before this scorer joined, of a run that does not need it
        return self._set


def custom_reward(function: str, env: str, name: str | None = None, weight: float = 1.0,
                  group: bool = False, runs: Sequence[str] = (), backfill: bool = False) -> CustomReward:
    """The custom scorer of ``function`` for ``env``, its options checked; its function and
    environment are loaded (and checked) by :meth:`CustomReward.start`, before any rollout."""
    module, _, attr = function.partition(":")
    if not module or not attr:
        raise ValueError(f"--function {function!r}: write it as 'package.module:name'")
    checked = attr if name is None else name
    if not _NAME.fullmatch(checked):
        raise ValueError(f"--name {checked!r}: use 1 to 128 letters, digits, '-' or '_' (it names the scorer in "
                         "subjects and its consumer)")
    if not _NAME.fullmatch(env):
        raise ValueError(f"--env {env!r}: use the environment's name as in its rollouts' subjects "
                         "(rollouts.<run>.<env>.<partition>): letters, digits, '-' or '_'")
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"--weight {weight}: a weight is a finite number, not negative")
    if runs and backfill:
        raise ValueError("--run and --backfill: choose one (--run scores the runs named, --backfill every stored "
                         "rollout)")
    for run in runs:
        if not _NAME.fullmatch(run):
            raise ValueError(f"--run {run!r}: a run id is letters, digits, '-' or '_'")
    return CustomReward(function, env, name, weight, group, runs, backfill)


class NotScored(Exception):
    """Rollouts of an eval run (``flywheel eval --record``) arrive with their scores: nothing to do."""


def run_config(state: events.RunState, trusted_modules: Sequence[str] = ()) -> RunConfig | None:
    """The run's config from its state (its parts by path only from ``trusted_modules``); None for
    a run registered without one."""
    if state.kind == "eval":
        raise NotScored(state.id)
    if not state.config:
        return None
    try:
        return RunConfig.parse(dict(state.config), source=f"run {state.id!r}: config", trusted_modules=trusted_modules)
    except ValueError as exc:
        raise Reject(str(exc)) from exc


class RunConfigs:
    """Each run's config and tenant, read from the run-state bucket and kept ``ttl_s``.

    A run's config is written when the run is created, so one read per run every few seconds
    serves every rollout in between; a config written after a run's first rollouts takes
    effect within ``ttl_s``. A run without state in the bucket (tasks published straight to
    the bus) has no config: its environment's own rewards and weights, in the workers of no tenant.
    """

    def __init__(self, bus: Bus, ttl_s: float, trusted_modules: Sequence[str] = ()) -> None:
        self.bus = bus
        self.ttl_s = ttl_s
        self.trusted_modules = trusted_modules  # the setting: where a config's parts by path may come from
        self._cache: dict[str, tuple[float, Any]] = {}  # run -> (when read, RunInfo or NotScored)

    async def __call__(self, run: str) -> RunInfo:
        now = time.monotonic()
        cached = self._cache.get(run)
        if cached is not None and now - cached[0] < self.ttl_s:
            if cached[1] is NotScored:
                raise NotScored(run)
            return cached[1]
        try:
            state = await get_run(self.bus, run)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise Reject(f"run {run!r}: its run-state entry does not decode ({exc})") from exc
        try:
            info = (RunInfo(run_config(state, self.trusted_modules), state.tenant) if state is not None
                    else RunInfo(None))
        except NotScored:
            self._cache[run] = (now, NotScored)
            raise
        self._cache[run] = (now, info)
        return info


@dataclass
class _Group:
    """The members of one group that arrived, waiting for the rest."""

    key: tuple[str, str]  # (run, group id)
    size: int
    found: RewardSet  # its group rewards are found.group_rewards
    weights: dict[str, float]  # the run's weights, over found's own
    started_s: float = field(default_factory=time.monotonic)
    members: dict[str, events.Rollout] = field(default_factory=dict)  # rollout id -> rollout
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    closing: bool = False

    def missing(self) -> list[int]:
        present = {r.index for r in self.members.values()}
        return [i for i in range(self.size) if i not in present]


class _Message:
    """The Scores of one delivered batch message's rollouts (a group, as inference publishes it),
    published as one batch once each rollout gave its own, in the message's order: the same
    message delivered again (after a crash before its ack) publishes the same batch, with the
    same id, which JetStream keeps once. A rollout that fails gives nothing (its siblings'
    Scores go without it; the message is delivered again and its batch then differs, so the
    readers' one score per rollout and scorer is what keeps the duplicates out)."""

    def __init__(self, size: int, publish: Publish, done: Callable[[], object]) -> None:
        self.parts: list[list[events.Score]] = [[] for _ in range(size)]
        self.left = size
        self.publish = publish
        self.done = done
        self.published: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def give(self, index: int, scores: list[events.Score]) -> None:
        """Add the Scores of the rollout at ``index``; the last one publishes the batch."""
        self.parts[index] = scores
        self.left -= 1
        if self.left == 0:
            self.done()
            task = asyncio.ensure_future(self.publish([s for part in self.parts for s in part]))
            task.add_done_callback(self._published)

    async def stored(self) -> None:
        """Until the batch is stored; raises what its publish raised."""
        await asyncio.shield(self.published)

    def _published(self, task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            self.published.set_exception(RuntimeError("the scores' publish was cancelled"))
        elif task.exception() is not None:
            self.published.set_exception(task.exception())  # type: ignore[arg-type]  # not None: the test above
        else:
            self.published.set_result(None)
        self.published.exception()  # retrieved: a sibling that failed waits on it no more


class Scorer:
    """Scores rollouts with the rewards of ``rewards`` (run in environment workers) and publishes
    the Scores, within the bounds of ``config`` (the settings' ``scorer`` section)."""

    def __init__(self, rewards: RewardSource, configs: Callable[[str], Awaitable[RunInfo]], publish: Publish,
                 config: ScorerSettings, watch: Watch | None = None,
                 owns: Callable[[str], bool] | None = None, tracer: trace.Tracer | None = None) -> None:
        self.rewards = rewards
        self.watch = watch  # the reward-hacking watch (flywheel_scorer.watch), on the built-in scorer
        self.configs = configs
        self.publish = publish
        self.reward_timeout_s = config.reward_timeout_s
        self.num_threads = config.num_threads
        self.max_held = config.max_held
        self.group_timeout_s = config.group_timeout_s
        # Whether this process scores a group's partition now (flywheel_scorer.partitions); None: every group.
        self.owns = owns
        self.tracer = tracer or trace.NoOpTracer()  # a span a reward run, under the rollout's trace
        self._scoring = asyncio.Semaphore(config.max_in_flight)
        self._groups: OrderedDict[tuple[str, str], _Group] = OrderedDict()  # oldest first
        self._closed: OrderedDict[tuple[str, str], set[str]] = OrderedDict()  # group -> rollout ids scored
        self._messages: dict[tuple[int, int], _Message] = {}  # batch messages being scored, by (id, stream seq)
        self._handing_back = asyncio.Event()
        self._failed: set[str] = set()  # rewards whose first failure was logged in full

    @property
    def num_held(self) -> int:
        """Rollouts waiting for the rest of their group."""
        return sum(len(g.members) for g in self._groups.values())

    async def handle(self, delivery: Delivery) -> None:
        rollout: events.Rollout = delivery.event
        together = self._message_of(delivery)
        try:
            async with self._scoring:
                try:
                    run = await self.configs(rollout.run)
                except NotScored:
                    scores = []
                    found = None
                else:
                    found = await self.rewards(rollout, run)
                    weights = dict(run.config.scorers) if run.config is not None else {}
                    scores = await self.score(rollout, found, weights)
                    scores += self._watched(rollout, scores)
        except BaseException:
            if together is not None:
                together.give(delivery.batch_index or 0, [])  # its siblings' scores go without it
            raise
        if together is None:
            if scores:
                await self.publish(scores)
        else:
            together.give(delivery.batch_index or 0, scores)
            await together.stored()
        if found is not None and found.group_rewards:
            await self._join_group(rollout, found, weights)

    def _message_of(self, delivery: Delivery) -> _Message | None:
        """What the rollouts of ``delivery``'s message publish together (None: the message holds it alone)."""
        if delivery.batch_index is None:
            return None
        key = (id(delivery.msg), delivery.stream_seq)
        message = self._messages.get(key)
        if message is None:
            size = int(delivery.headers.get(events.BATCH_HEADER, 1))
            message = self._messages[key] = _Message(size, self.publish, lambda: self._messages.pop(key, None))
        return message

    async def score(self, rollout: events.Rollout, found: RewardSet | None = None,
                    weights: dict[str, float] | None = None) -> list[events.Score]:
        """One Score per per-rollout reward, in the rewards' order, each at the run's weight for it
        (``weights``) or its own; raises Reject for what can never be scored. ``found``: the
        rollout's rewards (None: as for a run without a config)."""
        if found is None:
            found = await self.rewards(rollout, RunInfo(None))
        if not found.rewards or found.env is None:
            return []
        weights = weights or {}
        (outcomes,) = await self._outcomes(found.env.score, [rollout], found.rewards)
        return [score_event(rollout, o.name, weights.get(o.name, found.weights[o.name]), _outcome(o))
                for o in outcomes]

    async def _outcomes(self, run: Callable[..., Awaitable[list[list[RewardOutcome]]]],
                        rollouts: list[events.Rollout], names: list[str]) -> list[list[RewardOutcome]]:
        """``names`` run on ``rollouts`` in their environment's worker; a worker that fails them
        (it died) gives each an error saying so. Each failure is logged; each reward's time counted."""
        what = rollouts[0].id if len(rollouts) == 1 else rollouts[0].group_id
        with self.tracer.start_as_current_span(f"rewards {', '.join(names)}", attributes={
                "flywheel.rewards": ",".join(names), "flywheel.scored": what}):
            try:
                outcomes = await run(rollouts, names, self.reward_timeout_s, threads=self.num_threads)
            except WorkerError as exc:
                outcomes = [[RewardOutcome(name=name, error=f"its environment worker failed: {exc}") for name in names]
                            for _ in rollouts]
        for row, rollout in zip(outcomes, rollouts, strict=True):
            for o in row:
                metrics.REWARD_SECONDS.labels(o.name).observe(o.elapsed_s)
                if o.error is not None:
                    self._log_failure(o.name, o.error, [rollout.id])
        return outcomes

    def _watched(self, rollout: events.Rollout, scores: list[events.Score]) -> list[events.Score]:
        """The watch's flag of ``rollout``, if a detector fires; each detector's first flag in a run is logged."""
        if self.watch is None or rollout.status == "error" or not scores:
            return []
        flags = self.watch.see(rollout, completion_of(rollout), scores)
        for hook in hook_flags(rollout.metrics):  # the environment's own hooks flagged calls of it
            num = rollout.metrics[FLAG_METRIC + hook]
            flags[f"hook:{hook}"] = f"the environment's hook {hook!r} flagged {num:g} of its calls"
        for detector, why in flags.items():
            if self.watch.first_time(rollout.run, detector):
                log.warning("run %s: the reward-hacking watch flags rollout %s (%s): %s; later flags of this kind "
                            "are in the trace API (?flagged=true) and the run's 'flagged' metric",
                            rollout.run, rollout.id, detector, why)
        return [flag_score(rollout, flags)] if flags else []

    def _log_failure(self, name: str, error: str, ids: Sequence[str]) -> None:
        """Log a reward's failure: a warning the first time a reward fails, then at debug."""
        first = name not in self._failed
        self._failed.add(name)
        log.log(logging.WARNING if first else logging.DEBUG, "rollouts %s: %s%s", ",".join(ids), error,
                "; its later failures are logged at debug level and recorded on their scores" if first else "")

    # --- groups -------------------------------------------------------------------------

    async def _join_group(self, rollout: events.Rollout, found: RewardSet, weights: dict[str, float]) -> None:
        if self.owns is not None and not self.owns(rollout.group_id):
            raise HandBack(f"group {rollout.group_id}: its partition went to another scorer replica")
        key = (rollout.run, rollout.group_id)
        if key in self._closed:
            if rollout.id not in self._closed[key]:  # scored already otherwise: a redelivery, nothing new
                await self.publish([score_event(rollout, g, weights.get(g, found.weights[g]),
                                                f"group reward {g!r}: group {rollout.group_id} was scored "
                                                f"without this rollout (index {rollout.index}), which arrived after it")
                                    for g in found.group_rewards])
            return
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key, max(rollout.group_size, 1), found, weights)
        group.members[rollout.id] = rollout
        if len(group.members) >= group.size:
            await self._close(group, None)
            return
        while self.num_held > self.max_held:
            oldest = next((g for g in self._groups.values() if not g.closing), None)
            if oldest is None:  # every group held is being scored already
                break
            await self._close(oldest, f"the scorer held max_held={self.max_held} rollouts waiting for their groups")
        await self._wait(group)

    async def _wait(self, group: _Group) -> None:
        """Until the group is scored (or it times out here, or the scorer stops: the delivery is handed back)."""
        while not group.done.done():
            remaining = group.started_s + self.group_timeout_s - time.monotonic()
            if remaining <= 0 and not group.closing:
                await self._close(group, f"the rest did not arrive within group_timeout_s={self.group_timeout_s:g}s")
                break
            handing_back = asyncio.ensure_future(self._handing_back.wait())
            try:
                waiting: list[asyncio.Future[Any]] = [group.done, handing_back]
                await asyncio.wait(waiting, timeout=max(remaining, 0.05),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                handing_back.cancel()
            if self._handing_back.is_set() and not group.done.done():
                raise asyncio.CancelledError  # the consumer hands the delivery back (nak) for a redelivery
        group.done.result()  # a publish that failed fails every member: the bus retries them

    async def _close(self, group: _Group, incomplete: str | None) -> None:
        """Run the group rewards on the members that arrived, publish their Scores, release the members."""
        if group.closing:
            await asyncio.shield(group.done)
            return
        group.closing = True
        members = sorted(group.members.values(), key=lambda r: r.index)
        try:
            async with self._scoring:
                scores = await self._score_group(members, group, incomplete)
                await self.publish(scores)
        except BaseException as exc:
            self._groups.pop(group.key, None)
            group.done.set_exception(exc if isinstance(exc, Exception) else RuntimeError("scoring stopped"))
            group.done.exception()  # retrieved by every waiter; marked retrieved so none is left unseen
            raise
        self._groups.pop(group.key, None)
        self._closed[group.key] = set(group.members)
        while len(self._closed) > _NUM_CLOSED_GROUPS:
            self._closed.popitem(last=False)
        group.done.set_result(None)

    async def _score_group(self, members: list[events.Rollout], group: _Group, incomplete: str | None
                           ) -> list[events.Score]:
        """Every group reward of ``group`` on the members that arrived, reward by reward."""
        found = group.found
        assert found.env is not None
        outcomes = await self._outcomes(found.env.score_group, members, found.group_rewards)
        scores: list[events.Score] = []
        for i, name in enumerate(found.group_rewards):
            weight = group.weights.get(name, found.weights[name])
            if incomplete is None:
                scores += [score_event(r, name, weight, _outcome(o[i])) for r, o in zip(members, outcomes, strict=True)]
                continue
            error = (f"group reward {name!r}: group {members[0].group_id} scored incomplete, missing "
                     f"rollout indices {group.missing()} of {group.size}: {incomplete}")
            log.warning("%s", error)
            for r, o in zip(members, outcomes, strict=True):
                outcome = _outcome(o[i])
                scores.append(score_event(r, name, weight, error, outcome) if isinstance(outcome, Value)
                              else score_event(r, name, weight, f"{error}; {outcome}"))
        return scores

    def hand_back(self, partition: int) -> None:
        """The groups of ``partition`` held now stop waiting: their members are handed back (another
        replica scores the partition from now on, and the group forms again there)."""
        for key, group in list(self._groups.items()):
            if not group.closing and events.partition_of(key[1]) == partition:
                del self._groups[key]
                group.done.set_exception(HandBack(f"group {key[1]}: its partition went to another scorer replica"))
                group.done.exception()  # retrieved by every waiter; marked retrieved so none is left unseen

    async def hand_back_on(self, stopping: asyncio.Event) -> None:
        """A background task: once ``stopping`` is set, held deliveries stop waiting and are handed back."""
        await stopping.wait()
        self._handing_back.set()


def build(bus: Bus, rewards: RewardSource, config: ScorerSettings, start_time: datetime | None = None,
          replica: str | None = None, trusted_modules: Sequence[str] = ()) -> tuple[Partitions, Scorer]:
    """The consumers of ROLLOUTS that score with ``rewards`` (one a partition this replica takes:
    :mod:`flywheel_scorer.partitions`), and their scorer, within ``config``; a new durable starts
    at ``start_time`` (None: the stream's first rollout)."""
    watch = Watch() if config.watch and isinstance(rewards, EnvironmentRewards) else None
    publish = functools.partial(bus.publish_many, together=True)
    scorer = Scorer(rewards, RunConfigs(bus, config.run_config_ttl_s, trusted_modules), publish, config, watch,
                    tracer=bus.tracer_of(__name__))

    def consumer_for(k: int) -> Consumer:
        # Held group members take consumer slots (and server-side ack-pending room) beyond the
        # scoring bound, and the scorer never holds more than max_held: scoring always has room.
        return Consumer(bus, stream="ROLLOUTS", durable=f"{rewards.durable}-p{k}", handler=scorer.handle,
                        event_type=events.Rollout, filter_subject=partition_filter(rewards.filter_subject, k),
                        max_in_flight=config.max_in_flight + config.max_held, batch_size=config.max_in_flight,
                        max_deliver=MAX_DELIVER + HANDBACK_ALLOWANCE, ack_wait_s=config.ack_wait_s,
                        start_time=start_time)

    def joined(consumer: Consumer) -> None:
        said = rewards.joined(consumer.created, start_time)
        if said:  # on the user's screen: what it scores, from when
            log.info("%s", said)

    partitions = Partitions(bus, rewards.durable, consumer_for, scorer.hand_back, replica, on_first=joined)
    scorer.owns = partitions.owns
    return partitions, scorer


async def run(settings: Settings, rewards: RewardSource) -> None:
    """Composition root of a scorer process: connect, score until a signal, shut down; its bounds are
    the settings' ``scorer`` section, its environment workers the ``workers`` section. A custom
    scorer whose function or environment does not load raises ValueError before anything is scored."""
    config = settings.scorer
    bus = await Bus.for_settings(settings, rewards.durable)
    pool = WorkerPool(settings.workers, settings.data_dir, name=rewards.durable, sandbox=SandboxClient(bus))
    service = Service(rewards.durable, bus, info={"subjects": rewards.filter_subject or "rollouts.>",
                                                  "workers": pool.info})
    try:
        start = await rewards.start(bus, pool)
        partitions, scorer = build(bus, rewards, config, start, service.instance, settings.trusted_modules)
        service.add_task(partitions.serve)
        service.add_task(scorer.hand_back_on)
        await service.run()  # finishes or hands back the rollouts in flight, then drains the bus
    finally:
        await pool.close()


def _outcome(outcome: RewardOutcome) -> Value | str:
    """A worker's outcome of one reward as :func:`flywheel.sdk.scoring.score_event` takes it."""
    if outcome.error is not None:
        return outcome.error
    assert outcome.value is not None  # the host checked: a finite value, or an error
    return Value(outcome.value, dict(outcome.components))
