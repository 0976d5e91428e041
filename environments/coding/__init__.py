"""coding: write a Python function (or a small class) that passes hidden unit tests, run in a sandbox.

Each task describes one function with its signature and an example; its unit tests stay out
of the prompt. The model answers with its code in a fenced ```python block (the last one in
its final reply counts) and may first try code with the ``python`` tool, which runs in the
rollout's own sandbox (``tools=False``: one turn, no tool). The reward writes the answer as
``solution.py`` beside the task's tests and runs them in a one-shot sandbox
(:func:`flywheel.sdk.sandbox_tools.run_tests`: every test with its own deadline, the run with
another), so a wrong, crashing or never-ending answer costs nothing but its score; an answer
that does not parse, or is over ``MAX_CODE_CHARS``, fails without a run.

Rewards: ``tests`` (components ``all_passed``, weight ``1 - partial_credit``, and
``fraction`` of the tests passed, weight ``partial_credit``). Metrics: ``syntax_error`` (the
answer does not parse), ``no_code`` (no code block), ``timed_out`` (a test or the run passed
its deadline), ``python_calls``. A reward that cannot reach the sandbox service is a reward
error on the rollout, never a zero. The rewards of one rollout share one test run.

Tasks (``tasks.jsonl``, swappable with ``tasks_file``): ``id``, ``prompt``, ``entry_point``
(what the tests import from ``solution``), ``tests`` (a test file of top-level ``test_*``
functions with plain asserts; the sandbox has Python's standard library, no pytest) and a
reference ``solution``, which the environment's own tests check passes.

Not covered: the tests' verdict is as trustworthy as the tests (code written to game them,
such as an object equal to anything, can pass; see :mod:`flywheel.sdk.sandbox_test_runner`).
"""

from __future__ import annotations

import ast
import asyncio
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness
from flywheel.sdk.sandbox import SandboxSpec
from flywheel.sdk.sandbox_tools import SandboxTools, TestReport, run_tests

TASKS_FILE = Path(__file__).parent / "tasks.jsonl"
SCHEMA = {"id": str, "prompt": str, "entry_point": str, "tests": str, "solution": str}
SYSTEM_PROMPT = (
    "You write Python 3 code that hidden unit tests will check. Answer with the complete code (imports included) in "
    "one ```python fenced block; only the last such block of your final reply is tested, as the module `solution`. "
    "Python's standard library is available.")
TOOL_PROMPT = (
    " You may run code first with the `python` tool (your sandbox has no network); when you are done, reply without "
    "calling a tool.")

MAX_CODE_CHARS = 100_000  # longer answers fail without a run (the sandbox takes files up to 512 KB)
_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str | None:
    """The last fenced code block of the reply (tagged python or untagged), or None."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def syntax_error(code: str) -> str | None:
    """Why ``code`` does not parse, or None."""
    try:
        ast.parse(code)
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}"
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, absurd nesting
        return f"{type(exc).__name__}: {exc}"
    return None


class Verifier:
    """Runs a task's tests on an answer in a sandbox; the rewards of a rollout share one run
    (the last ``cache_size`` answers are kept)."""

    def __init__(self, spec: SandboxSpec, timeout_s: float, test_timeout_s: float, cache_size: int = 256) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.test_timeout_s = test_timeout_s
        self.cache_size = cache_size
        self._runs: OrderedDict[tuple[Any, ...], asyncio.Future[TestReport]] = OrderedDict()

    async def report(self, code: str, task: dict[str, Any]) -> TestReport:
        key = (asyncio.get_running_loop(), task["id"], task["tests"], code)
        pending = self._runs.get(key)
        if pending is None or (pending.done() and (pending.cancelled() or pending.exception() is not None)):
            pending = asyncio.ensure_future(run_tests({"solution.py": code, "test_solution.py": task["tests"]},
                                                      spec=self.spec, timeout_s=self.timeout_s,
                                                      test_timeout_s=self.test_timeout_s))
            self._runs[key] = pending
            while len(self._runs) > self.cache_size:
                self._runs.popitem(last=False)
        self._runs.move_to_end(key)
        return await asyncio.shield(pending)

    async def tests(self, completion: str, task: dict[str, Any]) -> dict[str, float]:
        code = runnable(completion)
        if code is None:
            return {"all_passed": 0.0, "fraction": 0.0}
        report = await self.report(code, task)
        return {"all_passed": float(report.all_passed), "fraction": report.fraction}

    async def timed_out(self, completion: str, task: dict[str, Any]) -> float:
        code = runnable(completion)
        if code is None:
            return 0.0
        report = await self.report(code, task)
        return float(report.timed_out or report.num_timeouts > 0)


def runnable(completion: str) -> str | None:
    """The answer's code when it is worth a test run: present, parsing, of a sane size."""
    code = extract_code(completion)
    if code is None or len(code) > MAX_CODE_CHARS or syntax_error(code) is not None:
        return None
    return code


def no_code(completion: str) -> float:
    return float(extract_code(completion) is None)


def has_syntax_error(completion: str) -> float:
    code = extract_code(completion)
    return float(code is not None and syntax_error(code) is not None)


def python_calls(state: dict) -> float:
    return float(state.get("sandbox_calls", {}).get("code", 0))


def prompt(task: dict[str, Any]) -> str:
    return task["prompt"]


def load_environment(tasks_file: str | None = None, tools: bool = True, max_turns: int = 8,
                     partial_credit: float = 0.0, timeout_s: float = 30.0, test_timeout_s: float = 5.0,
                     tool_timeout_s: float = 10.0, memory_mb: int = 512) -> Environment:
    """``tools``: offer the ``python`` tool (else one turn); ``partial_credit``: weight of the
    fraction of tests passed (the rest rewards passing them all); ``timeout_s`` /
    ``test_timeout_s``: limits of a test run and of each test; ``tool_timeout_s``: of each tool
    call; ``memory_mb``: of every sandbox."""
    if not 0.0 <= partial_credit <= 1.0:
        raise EnvironmentLoadError(f"coding: partial_credit={partial_credit}; give a number from 0 to 1")
    if max_turns < 1:
        raise EnvironmentLoadError(f"coding: max_turns={max_turns}; at least 1")
    spec = SandboxSpec(memory_mb=memory_mb)
    verifier = Verifier(spec, timeout_s, test_timeout_s)
    if tools:
        sandbox = SandboxTools(spec=spec, timeout_s=tool_timeout_s)
        harness = ChatHarness(system_prompt=SYSTEM_PROMPT + TOOL_PROMPT, tools=sandbox.tools("python"),
                              max_turns=max_turns)
    else:
        harness = ChatHarness(system_prompt=SYSTEM_PROMPT, max_turns=1)
    return Environment(
        name="coding",
        tasks=TaskSet.from_jsonl(tasks_file or TASKS_FILE, schema=SCHEMA),
        harness=harness,
        prompt=prompt,
        rewards=[Reward(verifier.tests, name="tests",
                        weights={"all_passed": 1.0 - partial_credit, "fraction": partial_credit}),
                 Metric(has_syntax_error, name="syntax_error"), Metric(no_code),
                 Metric(verifier.timed_out, name="timed_out"), Metric(python_calls)],
        sampling={"max_tokens": 2048},
    )
