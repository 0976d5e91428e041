"""The environment SDK: a task set, a harness and rewards, one object for eval and training.

An environment is a Python package (or module) whose ``load_environment(**args)`` returns an
:class:`Environment`::

    from flywheel.sdk.environment import Environment, GroupReward, Reward, TaskSet
    from flywheel.sdk.harness import ChatHarness

    def correct(completion: str, task: dict) -> float:
        return float(completion.strip() == task["answer"])

    def load_environment(**args) -> Environment:
        return Environment(
            name="arithmetic",
            tasks=TaskSet.from_jsonl("tasks.jsonl", schema={"question": str, "answer": str}),
            harness=ChatHarness(system_prompt="Answer with the number only."),
            rewards=[Reward(correct), GroupReward(shortest_correct, weight=0.1)],
        )

The same object serves ``flywheel eval`` (the harness runs against any OpenAI-compatible
endpoint) and training (the harness runs inside the inference service against the
interception endpoint, which records the tokens the trainer trains on). The harness never
knows which.

Rewards and metrics are plain functions, sync or async. They receive, by parameter name, any of
``completion`` (the final assistant message's text), ``messages`` (the final branch's messages,
OpenAI dicts), ``task`` (the row), ``state`` (what the harness recorded, e.g. a game's or a
database's final state), ``rollout`` (the :class:`flywheel.contract.events.Rollout`); they return a
float, or a dict of floats (components, summed with ``Reward.weights``, default 1 each). A
:class:`GroupReward` sees a whole group at once, through the same names in the plural
(``completions``, ``messages_list``, ``tasks``, ``states``, ``rollouts``) or ``task`` (the
group's shared row), and returns one value per rollout. A metric is a reward of weight 0: it
is recorded, never trained on. A reward that raises or returns a non-number is an error recorded
on that rollout's score, never a silent zero.

Environments are found by id (:func:`resolve`): a module name (``reverse_text``), or
``owner/name`` / ``owner/name@version`` registered by an installed package under the
``flywheel.environments`` entry-point group, ``verifiers:<taskset id>``, a verifiers taskset
(:mod:`flywheel.sdk.verifiers_bridge`), or ``openenv:<package>``, an OpenEnv environment
(:mod:`flywheel.sdk.openenv_bridge`). A run config can swap a reward's function,
change its weight, add one, and pass arguments to ``load_environment`` without touching the
environment's code (:class:`EnvironmentOverrides`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import json
import logging
import math
import os
import random
import shlex
import site
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from flywheel.contract import events
from flywheel.contract.hub import ENTRY_POINT_GROUP
from flywheel.contract.names import check_token
from flywheel.sdk import tracegraph
from flywheel.sdk.harness import RUNTIMES, ChatHarness, Harness, ProgramHarness
from flywheel.sdk.hooks import CallHooks, RequestHook, ResponseHook
from flywheel.sdk.messages import message_dict, message_from_dict

VERIFIERS_PREFIX = "verifiers:"  # env = "verifiers:<taskset id>"
OPENENV_PREFIX = "openenv:"  # env = "openenv:<package>"
# Packages of other formats by the prefix of their ids: the module of each one's bridge, whose
# load_environment(name, **args) builds the environment.
FORMATS = {VERIFIERS_PREFIX: "flywheel.sdk.verifiers_bridge", OPENENV_PREFIX: "flywheel.sdk.openenv_bridge"}

if TYPE_CHECKING:
    from flywheel.contract.config import EnvConfig

log = logging.getLogger(__name__)

REWARD_PARAMETERS = ("completion", "messages", "task", "state", "rollout")
GROUP_PARAMETERS = ("completions", "messages_list", "tasks", "task", "states", "rollouts")


class EnvironmentLoadError(ValueError):
    """An environment that cannot be used; the message says what to fix."""


class RewardError(ValueError):
    """A reward function raised or returned something other than a finite number."""


# --- task sets ----------------------------------------------------------------------------

Schema = Mapping[str, type | tuple[type, ...]]


class TaskSet:
    """Rows of a task set (JSON objects), from a list, a generator, JSONL or Parquet files, or a
    ``datasets`` dataset, checked against an optional ``schema`` (field -> type, or a tuple
    of accepted types; extra fields are allowed).

    :meth:`rows` returns ``num`` rows: for a fixed set, shuffled by ``seed`` and repeated when
    ``num`` exceeds its size; for a generator, whatever it yields for ``(num, seed)``.
    """

    def __init__(self, source: Callable[[int, int], Iterable[Mapping[str, Any]]], *, name: str,
                 schema: Schema | None = None, size: int | None = None) -> None:
        self._source = source
        self.name = name
        self.schema = dict(schema) if schema else None
        self.size = size

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], schema: Schema | None = None, name: str = "rows") -> TaskSet:
        rows = list(rows)
        if not rows:
            raise EnvironmentLoadError(f"task set {name!r} is empty: give at least one row")
        tasks = cls(lambda num, seed: _cycle(rows, num, seed), name=name, schema=schema, size=len(rows))
        for i, row in enumerate(rows):  # a fixed set is checked whole at load, in file order
            tasks.check(row, where=f"task set {name!r}, row {i}")
        return tasks

    @classmethod
    def from_generator(cls, generate: Callable[[int, int], Iterable[Mapping[str, Any]]],
                       schema: Schema | None = None) -> TaskSet:
        """``generate(num, seed)`` yields ``num`` rows, the same ones for the same seed."""
        return cls(generate, name=getattr(generate, "__qualname__", "generator"), schema=schema)

    @classmethod
    def from_jsonl(cls, *paths: str | Path, schema: Schema | None = None) -> TaskSet:
        rows: list[dict[str, Any]] = []
        for path in map(Path, paths):
            try:
                text = path.read_text()
            except OSError as exc:
                raise EnvironmentLoadError(f"task file {path}: {exc}") from exc
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise EnvironmentLoadError(f"task file {path}, line {n}: not JSON ({exc})") from exc
        return cls.from_rows(rows, schema, name=", ".join(map(str, paths)))

    @classmethod
    def from_parquet(cls, *paths: str | Path, schema: Schema | None = None) -> TaskSet:
        import pyarrow.parquet as pq

        rows = [row for path in paths for row in pq.read_table(path).to_pylist()]
        return cls.from_rows(rows, schema, name=", ".join(map(str, paths)))

    @classmethod
    def from_dataset(cls, dataset: Any, split: str | None = None, schema: Schema | None = None) -> TaskSet:
        """A ``datasets.Dataset`` (or a name / local path that ``datasets.load_dataset`` takes, with ``split``)."""
        if isinstance(dataset, str):
            import datasets

            dataset = datasets.load_dataset(dataset, split=split or "train")
        return cls.from_rows(list(dataset), schema, name=(getattr(dataset, "info", None) and dataset.info.dataset_name)
                             or "dataset")

    def rows(self, num: int, seed: int = 0) -> list[dict[str, Any]]:
        rows = [dict(r) if isinstance(r, Mapping) else r for r in self._source(num, seed)]
        for i, row in enumerate(rows):
            self.check(row, where=f"task set {self.name!r}, row {i}")
        return rows

    def check(self, row: Any, where: str = "task") -> None:
        """Raise :class:`EnvironmentLoadError` naming the field when ``row`` does not fit the schema."""
        if not isinstance(row, dict):
            raise EnvironmentLoadError(f"{where}: a {type(row).__name__}, not a JSON object")
        for key, expected in (self.schema or {}).items():
            if key not in row:
                raise EnvironmentLoadError(f"{where}: missing field {key!r} (schema: {_schema_text(self.schema)})")
            if not isinstance(row[key], expected) or (isinstance(row[key], bool) and bool not in _types(expected)):
                raise EnvironmentLoadError(f"{where}: field {key!r} is {row[key]!r} ({type(row[key]).__name__}); "
                                           f"the schema wants {_type_names(expected)}")


def _cycle(rows: list[Mapping[str, Any]], num: int, seed: int) -> list[Mapping[str, Any]]:
    out: list[Mapping[str, Any]] = []
    rng = random.Random(seed)
    while len(out) < num:
        order = list(rows)
        rng.shuffle(order)
        out.extend(order[:num - len(out)])
    return out


def _types(expected: type | tuple[type, ...]) -> tuple[type, ...]:
    return expected if isinstance(expected, tuple) else (expected,)


def _type_names(expected: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in _types(expected))


def _schema_text(schema: Schema | None) -> str:
    return ", ".join(f"{k}: {_type_names(v)}" for k, v in (schema or {}).items())


# --- rewards ------------------------------------------------------------------------------


def _parameters(fn: Callable[..., Any], allowed: Sequence[str], kind: str, name: str) -> tuple[str, ...]:
    if not callable(fn):
        raise EnvironmentLoadError(f"{kind} {name!r}: {fn!r} is not callable")
    params = tuple(inspect.signature(fn).parameters)
    unknown = [p for p in params if p not in allowed]
    if unknown:
        raise EnvironmentLoadError(f"{kind} {name!r} ({getattr(fn, '__qualname__', fn)}) takes {unknown}; a {kind} "
                                   f"takes any of {', '.join(allowed)} by name")
    return params


def _number(value: Any, name: str, weights: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """(value, components) from what a reward returned; raises RewardError on anything else."""
    if isinstance(value, Mapping):
        if not value:
            raise RewardError(f"reward {name!r} returned an empty dict; return a float or a dict of floats")
        components = {str(k): _number(v, f"{name}.{k}", {})[0] for k, v in value.items()}
        return sum(weights.get(k, 1.0) * v for k, v in components.items()), components
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value!r}; a reward returns a finite float or a dict of them")
    if abs(value) > events.SCORE_LIMIT:
        raise RewardError(f"reward {name!r} returned {value!r}, past the bound on a score "
                          f"(±{events.SCORE_LIMIT:g}); scale the reward down")
    return float(value), {}


async def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    value = fn(**kwargs)
    if inspect.isawaitable(value):
        value = await value
    return value


@dataclass(frozen=True)
class Value:
    """What one reward gave one rollout: its value (weighted components summed) and components."""

    value: float
    components: dict[str, float] = field(default_factory=dict)


@dataclass
class _Weighted:
    """A named reward function with its weight and the weights of its components.

    A sync function runs in a worker thread, so a slow one does not stall the scorer; the hop
    costs about 80 µs of CPU a call. ``inline=True`` says the function takes microseconds and
    does no I/O (a string comparison, a parse): it runs on the event loop instead. It cannot
    then be cut short at ``reward_timeout_s``, and the scorer logs a warning naming it when a
    call holds the loop longer than :data:`flywheel.sdk.scoring.INLINE_WARN_S` (10 ms)."""

    KIND: ClassVar[str]
    PARAMETERS: ClassVar[tuple[str, ...]]

    fn: Callable[..., Any]
    weight: float = 1.0
    name: str = ""
    weights: dict[str, float] = field(default_factory=dict)
    inline: bool = False

    def __post_init__(self) -> None:
        self.name = self.name or getattr(self.fn, "__name__", "")
        if not self.name or self.name == "<lambda>":
            raise EnvironmentLoadError(f"{self.KIND} {self.fn!r}: give it a name "
                                       f"({type(self).__name__}(fn, name=...))")
        _check_weight(self.name, self.weight)
        if self.inline and _is_async(self.fn):
            raise EnvironmentLoadError(f"{self.KIND} {self.name!r}: inline=True is for sync functions; an async one "
                                       "runs on the event loop already: drop inline")
        self.parameters = _parameters(self.fn, self.PARAMETERS, self.KIND, self.name)


@dataclass
class Reward(_Weighted):
    """A per-rollout reward function with its weight (0: a metric, recorded but not trained on).

    ``weights`` weigh the components of a dict-returning function (default 1 each).
    """

    KIND: ClassVar[str] = "reward"
    PARAMETERS: ClassVar[tuple[str, ...]] = REWARD_PARAMETERS

    async def __call__(self, rollout: events.Rollout) -> Value:
        available = {"completion": completion_of(rollout), "messages": messages_of(rollout),
                     "task": rollout.task_data, "state": rollout.state, "rollout": rollout}
        value = await _call(self.fn, {p: available[p] for p in self.parameters})
        return Value(*_number(value, self.name, self.weights))


def Metric(fn: Callable[..., Any], name: str = "", inline: bool = False) -> Reward:
    """A reward of weight 0: recorded with the rollout, not trained on (``inline``: see :class:`Reward`)."""
    return Reward(fn, weight=0.0, name=name, inline=inline)


@dataclass
class GroupReward(_Weighted):
    """A reward that sees every rollout of a group and returns one value per rollout (in order)."""

    KIND: ClassVar[str] = "group reward"
    PARAMETERS: ClassVar[tuple[str, ...]] = GROUP_PARAMETERS

    async def __call__(self, rollouts: Sequence[events.Rollout]) -> list[Value]:
        available = {"completions": [completion_of(r) for r in rollouts],
                     "messages_list": [messages_of(r) for r in rollouts],
                     "tasks": [r.task_data for r in rollouts], "task": rollouts[0].task_data,
                     "states": [r.state for r in rollouts], "rollouts": list(rollouts)}
        values = await _call(self.fn, {p: available[p] for p in self.parameters})
        if (isinstance(values, str | bytes | Mapping) or not isinstance(values, Sequence)
                or len(values) != len(rollouts)):
            raise RewardError(f"group reward {self.name!r} returned {values!r}; it returns a list with one value "
                              f"per rollout ({len(rollouts)})")
        return [Value(*_number(v, self.name, self.weights)) for v in values]


AnyReward = TypeVar("AnyReward", Reward, GroupReward)


def _is_async(fn: Callable[..., Any]) -> bool:
    # An object whose __call__ is async: its method is read to ask that, not whether fn is callable.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004  # reads the method to ask if it is async, not callable()


def off_the_loop(reward: AnyReward, executor: Executor | None = None) -> AnyReward:
    """``reward`` itself when its function is async or ``inline``, else a copy whose sync
    function runs in ``executor`` (None: asyncio's default), so a slow reward does not stall
    the event loop."""
    fn = reward.fn
    if reward.inline or _is_async(fn):
        return reward

    @functools.wraps(fn)
    async def threaded(**kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, **kwargs))

    return dataclasses.replace(reward, fn=threaded)


def _check_weight(name: str, weight: float) -> None:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise EnvironmentLoadError(f"reward {name!r}: weight={weight!r}; a weight is a finite number >= 0")


def shortest_correct_reward(is_correct: Callable[[str, dict[str, Any]], bool], weight: float = 0.1,
                            name: str = "shortest_correct") -> GroupReward:
    """A group reward against runaway length: 1.0 for the shortest correct answer(s) of the group
    (in characters), 0.0 for the others; a group with no correct answer gets 0.0 throughout."""

    def reward(completions: list[str], tasks: list[dict[str, Any]]) -> list[float]:
        lengths = [len(c) if is_correct(c, t) else None for c, t in zip(completions, tasks, strict=True)]
        best = min((n for n in lengths if n is not None), default=None)
        return [float(n is not None and n == best) for n in lengths]

    reward.__name__ = name
    return GroupReward(reward, weight=weight, name=name)


# --- rollouts as rewards see them --------------------------------------------------------


def final_branch(rollout: events.Rollout) -> list[events.Node]:
    """The branch (root to leaf) that ends at the rollout's last node (:func:`flywheel.sdk.tracegraph.final_branch`)."""
    return tracegraph.final_branch(rollout.nodes)


def completion_of(rollout: events.Rollout) -> str:
    """The rollout's final answer: the content of the last assistant message of its final branch."""
    for node in reversed(final_branch(rollout)):
        if node.message.role == "assistant":
            return node.message.content
    return ""


def messages_of(rollout: events.Rollout) -> list[dict[str, Any]]:
    """The final branch's messages, as OpenAI chat dicts."""
    return [message_dict(n.message) for n in final_branch(rollout)]


# --- the environment ------------------------------------------------------------------------


@dataclass
class Environment:
    """A task set, a harness and rewards. ``harness`` defaults to a single chat turn
    (:class:`flywheel.sdk.harness.ChatHarness` with no tools); ``prompt`` turns a row into the first
    messages (default: the row's ``prompt`` field, a string or a list of messages);
    ``reference`` gives a row's reference answer for supervised warm-up; ``sampling`` holds
    default sampling settings (temperature, top_p, max_tokens, stop) a run config may override."""

    name: str
    tasks: TaskSet | Sequence[Mapping[str, Any]]
    rewards: Sequence[Reward | GroupReward | Callable[..., Any]]
    harness: Harness | None = None
    prompt: Callable[[dict[str, Any]], Sequence[Mapping[str, Any]] | str] | None = None
    reference: Callable[[dict[str, Any]], str] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    version: str = "0.0.0"
    description: str = ""
    # Hooks on every model call of a rollout (flywheel.sdk.hooks): rewrite, block or flag requests; flag answers.
    request_hooks: Sequence[RequestHook] = ()
    response_hooks: Sequence[ResponseHook] = ()

    def call_hooks(self, task: Mapping[str, Any]) -> CallHooks:
        """The hooks of one rollout of ``task``."""
        return CallHooks(self.request_hooks, self.response_hooks, task)

    def __post_init__(self) -> None:
        if not isinstance(self.tasks, TaskSet):
            self.tasks = TaskSet.from_rows(self.tasks, name=f"{self.name} tasks")
        if self.harness is None:
            self.harness = ChatHarness()
        wrapped = [r if isinstance(r, Reward | GroupReward) else Reward(r) for r in self.rewards]
        if not wrapped:
            raise EnvironmentLoadError(f"environment {self.name!r} defines no rewards: give at least one")
        names = [r.name for r in wrapped]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise EnvironmentLoadError(f"environment {self.name!r}: reward names {dupes} are used twice")
        self.rewards = wrapped

    def _rewards(self) -> list[Reward | GroupReward]:
        """``rewards`` as :meth:`__post_init__` leaves them: every one a Reward or a GroupReward."""
        rewards = [r for r in self.rewards if isinstance(r, Reward | GroupReward)]
        assert len(rewards) == len(self.rewards)
        return rewards

    @property
    def rollout_rewards(self) -> dict[str, Reward]:
        return {r.name: r for r in self.rewards if isinstance(r, Reward)}

    @property
    def group_rewards(self) -> dict[str, GroupReward]:
        return {r.name: r for r in self.rewards if isinstance(r, GroupReward)}

    @property
    def weights(self) -> dict[str, float]:
        """Every reward's weight by name (metrics have 0)."""
        return {r.name: r.weight for r in self._rewards()}

    def load_tasks(self, num_tasks: int, seed: int = 0) -> list[dict[str, Any]]:
        assert isinstance(self.tasks, TaskSet)
        return self.tasks.rows(num_tasks, seed)

    def check_task(self, row: Any) -> None:
        assert isinstance(self.tasks, TaskSet)
        self.tasks.check(row, where=f"environment {self.name!r}: task")

    def first_messages(self, task: dict[str, Any]) -> list[events.Message]:
        """The messages a rollout starts from (the harness may add a system prompt before them)."""
        if self.prompt is not None:
            given = self.prompt(task)
        elif "prompt" in task:
            given = task["prompt"]
        else:
            raise EnvironmentLoadError(f"environment {self.name!r}: no prompt(task) and the task has no 'prompt' "
                                       f"field (fields: {sorted(task)})")
        if isinstance(given, str):
            given = [{"role": "user", "content": given}]
        return [message_from_dict(m, f"prompt[{i}]") for i, m in enumerate(given)]

    def prompt_messages(self, task: dict[str, Any]) -> list[events.Message]:
        """The first request's messages: the harness's system prompt, then :meth:`first_messages`."""
        assert self.harness is not None
        return self.harness.initial_messages(self, task)

    def privileged_messages(self, task: dict[str, Any], context: str) -> list[events.Message]:
        """:meth:`prompt_messages` with a privileged ``context`` first, as a system message
        (``{answer}`` in it becomes :meth:`reference_answer`): what a self-distillation teacher sees."""
        system = events.Message(role="system", content=context.format(answer=self.reference_answer(task)))
        return [system, *self.prompt_messages(task)]

    def reference_answer(self, task: dict[str, Any]) -> str:
        if self.reference is None:
            raise EnvironmentLoadError(f"environment {self.name!r} defines no reference(task): it cannot be used "
                                       "for SFT")
        return self.reference(task)

    def with_runtime(self, runtime: str | None) -> Environment:
        """This environment with its program harness run in ``runtime`` (``subprocess`` or
        ``sandbox``; a copy); None: as it is. A harness that is not a program is an error."""
        if runtime is None or getattr(self.harness, "runtime", None) == runtime:
            return self
        if runtime not in RUNTIMES:
            raise EnvironmentLoadError(f"runtime={runtime!r}: a program harness runs in one of {', '.join(RUNTIMES)}")
        if not isinstance(self.harness, ProgramHarness):
            raise EnvironmentLoadError(f"runtime={runtime!r}: environment {self.name!r} has a "
                                       f"{type(self.harness).__name__}, which runs in the process that runs its "
                                       "rollouts; only a program harness (ProgramHarness) takes a runtime, or "
                                       "give one with --harness (a run config's harness)")
        return dataclasses.replace(self, harness=dataclasses.replace(self.harness, runtime=runtime))

    def with_harness(self, command: str | None) -> Environment:
        """This environment with ``command`` (a command line; ``{python}`` is this Python) run as
        its harness, a :class:`ProgramHarness` (a copy); None: as it is."""
        if command is None:
            return self
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise EnvironmentLoadError(f"harness={command!r}: not a command line ({exc})") from None
        if not argv:
            raise EnvironmentLoadError(f"harness={command!r}: give a command line, e.g. '{{python}} agent.py'")
        return dataclasses.replace(self, harness=ProgramHarness(argv))

    def with_overrides(self, overrides: EnvironmentOverrides | None) -> Environment:
        """This environment with a run config's harness, runtime, reward swaps and weights applied (a copy)."""
        if overrides is not None and (overrides.harness is not None or overrides.runtime is not None):
            swapped = self.with_harness(overrides.harness).with_runtime(overrides.runtime)
            return swapped.with_overrides(dataclasses.replace(overrides, harness=None, runtime=None))
        if overrides is None or not overrides.rewards:
            return self
        by_name = {r.name: r for r in self._rewards()}
        for name, spec in overrides.rewards.items():
            current = by_name.get(name)
            if spec.function:
                from flywheel.contract.config import import_object  # pydantic: only where a reward is swapped

                try:
                    fn = import_object(spec.function)
                except ValueError as exc:
                    raise EnvironmentLoadError(f"rewards.{name}.function={spec.function!r}: {exc}") from exc
                group = spec.group or (isinstance(current, GroupReward) and spec.group is None)
                kind = GroupReward if group else Reward
                weight = spec.weight if spec.weight is not None else current.weight if current else 1.0
                # Components of the same name keep their weights under the new function.
                by_name[name] = kind(fn, weight=weight, name=name,
                                     weights=dict(current.weights) if current else {})
            elif current is None:
                raise EnvironmentLoadError(f"rewards.{name}: environment {self.name!r} has no reward {name!r} "
                                           f"(it has {sorted(by_name)}); give `function` to add one")
            elif spec.weight is not None:
                by_name[name] = type(current)(current.fn, weight=spec.weight, name=name, weights=current.weights)
        return dataclasses.replace(self, rewards=list(by_name.values()))  # hooks and the rest kept


@dataclass(frozen=True)
class RewardOverride:
    weight: float | None = None
    function: str | None = None  # "package.module:function"
    group: bool | None = None


@dataclass(frozen=True)
class EnvironmentOverrides:
    """What a run config changes in an environment: ``args`` for ``load_environment`` and
    reward swaps/weights (``[rewards.<name>]`` with ``weight`` and/or ``function``)."""

    args: dict[str, Any] = field(default_factory=dict)
    rewards: dict[str, RewardOverride] = field(default_factory=dict)
    sha256: str | None = None  # a hub environment's pinned wheel (RunConfig.hub_pins), installed when missing
    harness: str | None = None  # a command line run as its harness (a ProgramHarness); None: its own
    runtime: str | None = None  # where its program harness runs (ProgramHarness.runtime); None: its own


# --- finding environments -----------------------------------------------------------------


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available() -> dict[str, str]:
    """Installed environments: id -> version of the package that registers it."""
    out = {}
    for name, ep in sorted(_entry_points().items()):
        out[name] = ep.dist.version if ep.dist else "?"
    return out


def other_ids(env_id: str) -> list[str]:
    """The other ids of the installed environment ``env_id`` names, as a run config may name it:
    for an ``owner/name`` id (no version) the module its entry point loads
    (``flywheel/reverse-text``: ``reverse_text``), for a module the ids whose entry points load
    it; none for an id no installed package registers."""
    modules = {name: ep.module for name, ep in _entry_points().items()}
    if env_id in modules:
        return [modules[env_id]]
    return sorted(name for name, module in modules.items() if module == env_id)


class EnvironmentNotInstalled(EnvironmentLoadError):
    """No installed package provides the environment."""


def refresh_installed() -> None:
    """Let this process see packages installed since it started: forget the import system's
    cached folder listings, and read the site folders' ``.pth`` files again (an editable install
    adds one, which Python reads only at start)."""
    importlib.invalidate_caches()
    folders = [*site.getsitepackages(), site.getusersitepackages(),
               *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))]
    for folder in dict.fromkeys(folders):
        if os.path.isdir(folder):
            site.addsitedir(folder)


class EnvironmentVersionMismatch(EnvironmentLoadError):
    """The environment is installed, at another version than the one asked for."""


def resolve(env_id: str) -> Callable[..., Environment]:
    """The ``load_environment`` function of ``env_id``: a module name, or ``owner/name[@version]``
    registered under the ``flywheel.environments`` entry-point group. An environment not found
    is looked for once more after :func:`refresh_installed`, so a process that started before
    its package was installed finds it. Nothing is installed here: a hub environment is
    installed by the host of its workers, into a folder of its own (:mod:`flywheel.runtime.installs`)."""
    try:
        return _resolve(env_id)
    except EnvironmentNotInstalled:
        refresh_installed()
    return _resolve(env_id)


def import_format(module: str, distribution: str, prefix: str) -> Any:
    """``module`` of another format's library (verifiers, openenv-core), as a bridge imports it in
    an environment's worker; a load error saying how to install it where it is missing."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the library is there and a dependency of it is not: its own error says which
        raise EnvironmentLoadError(f"{distribution} is not installed for this environment: install its package with "
                                   f"its dependencies into a folder of its own: flywheel env install "
                                   f"{prefix}<package or path>") from exc


def _resolve(env_id: str) -> Callable[..., Environment]:
    prefix = next((p for p in FORMATS if env_id.startswith(p)), None)
    if prefix is not None:  # a package of another format, through its bridge (a module, as any environment)
        name = env_id.removeprefix(prefix).partition("@")[0]
        if not name:
            raise EnvironmentLoadError(f"environment {env_id!r}: name the package after {prefix!r}, e.g. "
                                       f"{prefix}my-env")
        return functools.partial(importlib.import_module(FORMATS[prefix]).load_environment, name)
    name, _, version = env_id.partition("@")
    eps = _entry_points()
    if name in eps:
        ep = eps[name]
        installed = ep.dist.version if ep.dist else None
        if version and installed != version:
            raise EnvironmentVersionMismatch(f"environment {env_id!r}: version {installed} is installed, not "
                                             f"{version}; install the wanted one (pip install '<package>=={version}', "
                                             f"or flywheel env install {env_id} from the hub, into a folder of its "
                                             "own)")
        target = ep.load()
        return target if not inspect.ismodule(target) else _module_loader(target, env_id)
    if "/" in name:
        raise EnvironmentNotInstalled(f"environment {env_id!r} is not installed: no package registers {name!r} under "
                                   f"the {ENTRY_POINT_GROUP!r} entry points (installed: {sorted(eps) or 'none'})")
    module_name = name.replace("-", "_")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name.split(".")[0] and exc.name != module_name:
            raise  # the module exists and is broken: show its own error
        raise EnvironmentNotInstalled(f"environment {env_id!r}: no module {module_name!r}; install its package or put "
                                   f"it on PYTHONPATH (installed environments: {sorted(eps) or 'none'})") from exc
    return _module_loader(module, env_id)


def _module_loader(module: Any, env_id: str) -> Callable[..., Environment]:
    fn = getattr(module, "load_environment", None)
    if not callable(fn):
        raise EnvironmentLoadError(f"environment {env_id!r} ({getattr(module, '__file__', module.__name__)}) defines "
                                   f"no load_environment(**args) -> Environment")
    return fn


def load_environment(env_id: str, overrides: EnvironmentOverrides | None = None) -> Environment:
    """Find ``env_id`` (:func:`resolve`), build its :class:`Environment` with the overrides' args,
    apply reward overrides."""
    loader = resolve(env_id)
    args = dict(overrides.args) if overrides else {}
    try:
        env = loader(**args)
    except EnvironmentLoadError:
        raise
    except TypeError as exc:
        raise EnvironmentLoadError(f"environment {env_id!r}: load_environment({', '.join(args)}) failed: "
                                   f"{exc}") from exc
    if not isinstance(env, Environment):
        raise EnvironmentLoadError(f"environment {env_id!r}: load_environment returned a {type(env).__name__}, not "
                                   f"an Environment")
    return env.with_overrides(overrides)


def subject_name(env_id: str, name: str) -> str:
    """The environment's name in subjects (``tasks.<run>.<env>``): ``env_id`` itself when it is a
    plain module name, else the environment's ``name`` (an id with '/', '@' or '.' is not a
    subject token)."""
    if not any(c in env_id for c in "/@.:"):
        return check_token("env", env_id)
    return check_token(f"environment {env_id!r}: its name", name)


def overrides_of(env: EnvConfig, sha256: str | None = None) -> EnvironmentOverrides:
    """What a run changes in one of its environments: its ``args`` and ``rewards`` tables (and,
    for a hub environment, the ``sha256`` the run pinned)."""
    return EnvironmentOverrides(args=dict(env.args), rewards={
        name: RewardOverride(weight=r.weight, function=r.function, group=r.group) for name, r in env.rewards.items()},
        sha256=sha256, harness=env.harness, runtime=env.runtime)
