"""reasoning_tasks: any of reasoning-gym's procedural reasoning tasks, scored by its own verifiers.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates tasks offline from a
seed (``leg_counting``, ``basic_arithmetic``, ``maze``, ``sudoku``, ``knights_knaves`` and a
hundred more) and scores an answer with each task's own ``score_answer``. ``task`` names one;
``config`` holds that task's own settings (its difficulty and sizes: the fields of its config
dataclass, e.g. ``{"min_animals": 2, "max_animals": 4}`` for ``leg_counting``), passed to
``reasoning_gym.create_dataset``. ``task = "composite"`` mixes several, each a table of ``name``,
``weight`` and ``config`` in ``config.datasets``. It is an optional extra: ``pip install
'flywheel-rl[reasoning]'``.

The model thinks, then gives its final answer inside ``<answer>...</answer>`` (reasoning-gym's
own system prompt says so; ``system_prompt`` swaps it, by the name of one of reasoning-gym's
prompts or as text). The reward ``score`` is reasoning-gym's ``score_answer`` on the text of the
last answer tags (0 to 1: some tasks give partial credit; no tags, or an answer its scorer cannot
read, scores 0); metrics ``format`` (the reply has answer tags around a non-empty answer) and
``correct`` (the score is 1).

Splits: reasoning-gym draws item ``i`` of a dataset of seed ``s`` from ``Random(s + i)``, so a
split is a range of those seeds. ``split = "train"`` takes its seeds from ``[0, 2**31)`` and
``split = "test"`` (the held-out split, for evals) from ``[2**31, 2**32)``: no item of one is an
item of the other. Within a split, a run's task seed ``n`` starts at the split's start plus
``(n mod 2048) * 2**20``, so seeds 0 to 2047 give disjoint sets of tasks (up to 2**20 - 1024 each:
the rest is a composite's margin, whose part ``k`` draws from ``Random(s + k + 1 + i)``). A
task drawn from a fixed pool rather than generated (``arc_agi``, ``rearc``, ``codeio``...) can
be drawn by both splits, and a small configuration space can generate one question twice.

A row holds the question, the answer (``""`` where the task has no single one), and what
regenerates its reasoning-gym entry for scoring (``task``, ``seed``, ``size``, ``index``): the
entry's ``metadata`` (what many tasks score with) holds tuples and other values a JSON row would
not keep, so the scorer rebuilds the entry rather than carry it, and checks that its question is
the row's (rows made by another reasoning-gym version, or another ``config``, are an error).
One chat turn, no tools. ``reference(task)`` is the answer in its tags, for a supervised warm-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.metadata
import json
import threading
from collections.abc import Mapping
from typing import Any

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness

EXTRA = "reasoning"  # flywheel-rl[reasoning]: the reasoning-gym version the tests passed with
SPLITS = {"train": 0, "test": 2**31}  # where each split's seeds start; each is 2**31 seeds long
SPLIT_SEEDS = 2**31
WINDOW = 2**20  # seeds per run seed, within a split
# Tasks one call may ask for: a composite's part i draws item j from Random(seed + i + 1 + j), so
# a window keeps a margin for the parts (reasoning-gym has about a hundred tasks).
MAX_TASKS = WINDOW - 1024
SCHEMA = {"question": str, "answer": str, "task": str, "seed": int, "size": int, "index": int}


def _reasoning_gym() -> Any:
    """The reasoning_gym module, or a load error saying which extra installs it."""
    try:
        import reasoning_gym
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "reasoning_gym":
            raise  # reasoning_gym is there and a dependency of it is not: its own error says which
        raise EnvironmentLoadError(f"reasoning_tasks needs the reasoning-gym package: pip install "
                                   f"'flywheel-rl[{EXTRA}]' (or pip install reasoning-gym)") from exc
    return reasoning_gym


def _version() -> str:
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def task_names() -> list[str]:
    """Every task reasoning-gym registers (``composite`` included)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def config_fields(task: str) -> dict[str, Any]:
    """The settings of ``task``'s config (name -> default), less ``seed`` and ``size`` (the split's)."""
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[task][1]
    out = {}
    for f in dataclasses.fields(config_cls):
        if f.name in ("seed", "size"):
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None
    return out


def _check(task: str, config: Mapping[str, Any], split: str) -> None:
    if split not in SPLITS:
        raise EnvironmentLoadError(f"reasoning_tasks: split={split!r}; use one of {', '.join(SPLITS)}")
    _check_task(task, config, "task", "config")
    try:
        _dataset(task, _frozen(config), 0, 1)
    except Exception as exc:  # a setting out of its range: the task's own check says which
        raise EnvironmentLoadError(f"reasoning_tasks: {task} with config {dict(config)!r}: "
                                   f"{exc or type(exc).__name__}") from exc


def _check_task(task: Any, config: Any, task_at: str, config_at: str) -> None:
    """Refuse a task that reasoning-gym does not have, a config that is not a table, a key that
    is not one of the task's settings, and seed or size (the split's); a composite's parts too."""
    names = task_names()
    if not isinstance(task, str) or task not in names:
        close = difflib.get_close_matches(str(task), names, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise EnvironmentLoadError(f"reasoning_tasks: {task_at}={task!r} is not a reasoning-gym {_version()} "
                                   f"task{hint}; the tasks: {', '.join(names)}")
    if not isinstance(config, Mapping):
        raise EnvironmentLoadError(f"reasoning_tasks: {config_at}={config!r}; it is a table of {task}'s settings")
    fields = config_fields(task)
    own = sorted(k for k in config if k in ("seed", "size"))
    if own:
        raise EnvironmentLoadError(f"reasoning_tasks: {config_at} sets {', '.join(own)}; the split and the run's "
                                   "task seed choose them (split = \"train\" or \"test\")")
    unknown = sorted(k for k in config if k not in fields)
    if unknown:
        settings = ", ".join(f"{k} (default {v!r})" for k, v in fields.items()) or "none"
        raise EnvironmentLoadError(f"reasoning_tasks: {config_at} key(s) {', '.join(map(repr, unknown))} are not "
                                   f"settings of {task!r}; its settings: {settings}")
    if task == "composite":
        parts = config.get("datasets")
        if not isinstance(parts, list) or not parts:
            raise EnvironmentLoadError(f"reasoning_tasks: {config_at}.datasets={parts!r}; a composite mixes a list "
                                       "of tasks: datasets = [{name = \"leg_counting\", weight = 1, config = {...}}, "
                                       "...]")
        for i, part in enumerate(parts):
            where = f"{config_at}.datasets[{i}]"
            if not isinstance(part, Mapping) or "name" not in part or set(part) - {"name", "weight", "config"}:
                raise EnvironmentLoadError(f"reasoning_tasks: {where}={part!r}; each part is a table of name, weight "
                                           "(default 1) and config (default {})")
            _check_task(part["name"], part.get("config", {}), f"{where}.name", f"{where}.config")


def _frozen(config: Mapping[str, Any]) -> str:
    """The config as a cache key (its JSON text: it came from a run config's TOML)."""
    return json.dumps(dict(config), sort_keys=True, default=repr)


@functools.lru_cache(maxsize=32)
def _dataset(task: str, config_key: str, seed: int, size: int) -> Any:
    config = json.loads(config_key)
    if task == "composite":  # its parts as reasoning-gym's own specs
        from reasoning_gym.composite import DatasetSpec

        config["datasets"] = [DatasetSpec(name=part["name"], weight=part.get("weight", 1),
                                          config=dict(part.get("config", {}))) for part in config["datasets"]]
    return _reasoning_gym().create_dataset(task, seed=seed, size=size, **config)


# Sync rewards run on several threads, and some tasks generate an item with numpy's global
# random state (np.random.seed, then draws): one item at a time, or two would mix their draws.
_GENERATING = threading.Lock()


@functools.lru_cache(maxsize=4096)
def _entry(task: str, config_key: str, seed: int, size: int, index: int) -> dict[str, Any]:
    with _GENERATING:
        return dict(_dataset(task, config_key, seed, size)[index])


def first_seed(split: str, seed: int) -> int:
    """The reasoning-gym seed of the first task a run's task ``seed`` gets in ``split``."""
    return SPLITS[split] + (seed % (SPLIT_SEEDS // WINDOW)) * WINDOW


def generate(task: str, config: Mapping[str, Any], split: str):
    key = _frozen(config)

    def rows(num: int, seed: int) -> list[dict[str, Any]]:
        if num > MAX_TASKS:
            raise EnvironmentLoadError(f"reasoning_tasks: {num} tasks asked for at once; at most {MAX_TASKS} a seed")
        start = first_seed(split, seed)
        out = []
        for i in range(num):
            entry = _entry(task, key, start, num, i)
            answer = entry.get("answer")
            out.append({"question": entry["question"], "answer": "" if answer is None else str(answer),
                        "task": task, "seed": start, "size": num, "index": i})
        return out

    rows.__qualname__ = f"reasoning_tasks_{task}_{split}"
    return rows


def extract_answer(completion: str) -> str | None:
    """The text of the reply's last ``<answer>...</answer>``, stripped (reasoning-gym's own
    parsing), or None when there is none."""
    from reasoning_gym.utils import extract_answer as extract

    answer: str | None = extract(completion)
    return answer


def load_environment(task: str = "leg_counting", config: Mapping[str, Any] | None = None, split: str = "train",
                     system_prompt: str = "default", max_tokens: int = 1024) -> Environment:
    """``task``: a reasoning-gym task's name; ``config``: its settings (the fields of its config
    dataclass but seed and size); ``split``: ``train`` or ``test`` (held out: other seeds);
    ``system_prompt``: the name of one of reasoning-gym's system prompts (``default``,
    ``DeepSeekZero``, ``simple``, ``direct``, ``chain_of_draft``) or a prompt of your own;
    ``max_tokens``: the default reply budget."""
    _reasoning_gym()
    name, config = task, dict(config or {})
    _check(name, config, split)
    key = _frozen(config)
    from reasoning_gym.utils import SYSTEM_PROMPTS

    instructions = SYSTEM_PROMPTS.get(system_prompt, system_prompt)

    def entry_of(row: dict[str, Any]) -> dict[str, Any]:
        if row.get("task") != name:
            raise ValueError(f"a row of reasoning-gym task {row.get('task')!r} scored by the {name!r} environment")
        entry = _entry(name, key, int(row["seed"]), int(row["size"]), int(row["index"]))
        if entry["question"] != row["question"]:
            raise ValueError(f"reasoning-gym {_version()} generates another question for {name} seed {row['seed']} "
                             f"index {row['index']} with config {config!r}: the row was made by another version "
                             "or config")
        return entry

    def graded(completion: str, row: dict[str, Any]) -> float:
        entry = entry_of(row)
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        try:
            return float(_dataset(name, key, int(row["seed"]), int(row["size"])).score_answer(answer, entry))
        except Exception:  # an answer its scorer cannot read (a parse error in sympy, say) is a wrong one
            return 0.0

    def score(completion: str, task: dict[str, Any]) -> float:
        return graded(completion, task)

    def correct(completion: str, task: dict[str, Any]) -> float:
        return float(graded(completion, task) == 1.0)

    def formatted(completion: str) -> float:
        return float(bool(extract_answer(completion)))

    def reference(row: dict[str, Any]) -> str:
        if not row["answer"]:
            raise EnvironmentLoadError(f"reasoning_tasks: {name} has no single answer to a task (its scorer checks "
                                       "an answer against the task's rules): it gives no reference for SFT")
        return f"<answer>{row['answer']}</answer>"

    return Environment(
        name="reasoning_tasks",
        tasks=TaskSet.from_generator(generate(name, config, split), schema=SCHEMA),
        harness=ChatHarness(system_prompt=instructions, max_turns=1),
        prompt=lambda row: row["question"],
        reference=reference,
        rewards=[Reward(score), Metric(formatted, name="format", inline=True), Metric(correct)],
        sampling={"temperature": 1.0, "max_tokens": max_tokens},
        version=f"0.1.0+reasoning-gym.{_version()}",
        description=__doc__.split("\n\n")[0],
    )
