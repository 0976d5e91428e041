"""Sandbox tools: ``bash`` and ``python`` for a harness, and unit tests for rewards.

Harness side. :class:`SandboxTools` gives a :class:`~flywheel.sdk.harness.ChatHarness` the tools
``bash(command)`` and ``python(code)``, run in one sandbox session per rollout: created on the
first call (or by the harness's ``setup`` through :func:`sandbox_session`, to put files in it
first) from the environment's :class:`~flywheel.sdk.sandbox.SandboxSpec`, labelled
``flywheel-rollout=<rollout id>`` (so a bulk destroy by label finds leftovers), and destroyed
when the rollout ends, whether the harness finished or raised (``RolloutContext.on_close``).
Files and the working folder persist between calls; shell variables and background processes
do not (each call is a fresh process). The model gets the exit code, stdout and stderr, cut to
``max_output_chars`` each (head and tail kept, the cut said), and a timed-out command is killed
and said to be. A bad call (empty or oversized input) or a sandbox the model's own commands
killed is answered as a tool error the model can read; a missing sandbox service fails the
rollout (:class:`SandboxUnavailable`), so it is recorded as an error, never scored as the
model's failure. A service at its cap of live sandboxes makes a create (or a test run) wait
for room, up to :data:`flywheel.sdk.sandbox.CAPACITY_WAIT_S`, before that error.

The tools reach the service through ``ctx.sandbox_client``, which whoever runs the harness
sets: the inference service over its bus, ``flywheel eval`` where NATS is reachable.

Reward side. :func:`run_tests` writes files into a one-shot sandbox and runs unit tests there
(with :mod:`flywheel.sdk.sandbox_test_runner`, stdlib only, or any command of yours) and returns a
:class:`TestReport`: tests passed, timed out, the output's tail. Rewards run in the scorer (or
in ``flywheel eval``), which has no rollout context: they use :func:`default_client`, the
client :func:`use_client` set, else one connection per process to setting ``nats_url``.

What the sandbox isolates is said in the sandbox service's docstring (``flywheel_sandbox``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import re
import secrets
import signal
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from flywheel.contract import natsusers
from flywheel.sdk.harness import RolloutContext, Tool, ToolError
from flywheel.sdk.sandbox import (  # the rollout's session lives beside the client; its names stay importable here
    NO_SERVICE,
    SERVICE_FAILURES,
    ExecResult,
    SandboxClient,
    SandboxError,
    SandboxSpec,
    SandboxUnavailable,
    sandbox_session,
    service_unavailable,
    when_there_is_room,
)
from flywheel.sdk.sandbox_test_runner import collect_tests

if TYPE_CHECKING:
    from flywheel.contract.bus import Bus

MAX_INPUT_CHARS = 100_000  # a command or program; NATS carries about 1 MB a message
RUNNER_FILE = "flywheel_test_runner.py"
CONNECT_TIMEOUT_S = 2.0  # how long default_client waits for NATS


def cut(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` with its middle replaced by a note when longer than ``max_chars`` (the head and
    the tail are where commands say what went wrong)."""
    if len(text) <= max_chars:
        return text, False
    head = max_chars * 2 // 3
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - max_chars} characters cut ...]\n{text[len(text) - tail:]}", True


def signal_name(number: int) -> str:
    if number == signal.SIGKILL:
        return "SIGKILL: the sandbox's memory or process limit, or a kill"
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def describe(result: ExecResult, timeout_s: float, max_output_chars: int) -> str:
    """What the model reads of one command: how it ended, then its output streams."""
    if result.timed_out:
        lines = [f"timed out after {timeout_s:g} s: the command and everything it started were killed"]
    elif result.exit_code < 0:
        lines = [f"killed by signal {-result.exit_code} ({signal_name(-result.exit_code)})"]
    else:
        lines = [f"exit code {result.exit_code}"]
    for name, text, truncated in (("stdout", result.stdout, result.stdout_truncated),
                                  ("stderr", result.stderr, result.stderr_truncated)):
        if not text and not truncated:
            continue
        shown, was_cut = cut(text, max_output_chars)
        if truncated:  # the sandbox kept only the first len(text) characters
            note = f" (more than {len(text)} characters: showing {max_output_chars if was_cut else len(text)} " \
                   f"of the first {len(text)})"
        else:
            note = f" (showing {max_output_chars} of {len(text)} characters)" if was_cut else ""
        lines.append(f"--- {name}{note} ---\n{shown.rstrip(chr(10))}")
    if len(lines) == 1:
        lines.append("(no output)")
    return "\n".join(lines)


@dataclass
class SandboxTools:
    """``bash`` and ``python`` tools over the rollout's sandbox session.

    ``spec``: the session's resources, files and env (image, memory, network...); ``timeout_s``:
    each call's limit; ``max_output_chars``: per stream, what the model is shown; ``python``:
    the interpreter inside the sandbox."""

    spec: SandboxSpec = field(default_factory=SandboxSpec)
    timeout_s: float = 30.0
    max_output_chars: int = 4000
    python_executable: str = "python3"

    def tools(self, *names: str) -> list[Tool]:
        """The tools named (``bash``, ``python``; default both), for a harness's ``tools``."""
        limit = f"Each call may run {self.timeout_s:g} s; longer ones are killed."
        offered = {
            "bash": Tool(self.bash, description=f"Run a bash command in your sandbox (working folder /work; files "
                                                f"and the current folder persist between calls, shell variables "
                                                f"do not). Returns the exit code, stdout and stderr. {limit}"),
            "python": Tool(self.python, description=f"Run a Python 3 program in your sandbox (working folder /work) "
                                                    f"and return its exit code, stdout and stderr; print what you "
                                                    f"want to see. {limit}"),
        }
        unknown = sorted(set(names) - set(offered))
        if unknown:
            raise ValueError(f"SandboxTools.tools: no tool {unknown}; there are {sorted(offered)}")
        return [offered[name] for name in names or offered]

    async def bash(self, command: str, ctx: RolloutContext) -> str:
        """Run a bash command in the sandbox."""
        return await self.run(ctx, command, command, stdin="", what="command")

    async def python(self, code: str, ctx: RolloutContext) -> str:
        """Run a Python program in the sandbox."""
        return await self.run(ctx, [self.python_executable, "-"], code, stdin=code, what="code")

    async def run(self, ctx: RolloutContext, cmd: str | list[str], given: str, stdin: str, what: str) -> str:
        """Run ``cmd`` for a tool call whose input is ``given`` (checked first); the model's view."""
        if not given.strip():
            raise ToolError(f"{what} is empty")
        if len(given) > MAX_INPUT_CHARS:
            raise ToolError(f"{what} is {len(given)} characters, over the limit of {MAX_INPUT_CHARS}: write large "
                            "files in parts")
        if "\x00" in given:
            raise ToolError(f"{what} holds a NUL character")
        client, box = await sandbox_session(ctx, self.spec)
        try:
            result = await client.exec(box, cmd, stdin=stdin, timeout_s=self.timeout_s)
        except SandboxError as exc:
            if exc.kind in SERVICE_FAILURES:
                raise service_unavailable(exc) from exc
            raise ToolError(f"the sandbox could not run it: {exc.error}") from None
        counts = ctx.state.setdefault("sandbox_calls", {})
        counts[what] = counts.get(what, 0) + 1
        return describe(result, self.timeout_s, self.max_output_chars)


# --- the client rewards use -----------------------------------------------------------------

_current: contextvars.ContextVar[SandboxClient | None] = contextvars.ContextVar("flywheel_sandbox_client",
                                                                               default=None)
_connected: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[tuple[Bus, SandboxClient]]] = \
    weakref.WeakKeyDictionary()


@contextlib.contextmanager
def use_client(client: SandboxClient | None) -> Iterator[None]:
    """Within the block (and the tasks it starts), :func:`default_client` returns ``client``."""
    token = _current.set(client)
    try:
        yield
    finally:
        _current.reset(token)


async def connect(nats_url: str, timeout_s: float = 2.0) -> tuple[Bus, SandboxClient]:
    """A bus connection to ``nats_url`` and a client over it; :class:`SandboxUnavailable` when
    NATS does not answer within ``timeout_s``."""
    from flywheel.contract.bus import Bus, BusConfig

    try:
        bus = await Bus.connect(nats_url, "flywheel-sandbox-tools", BusConfig(connect_timeout_s=timeout_s),
                                ensure=False)
    except ConnectionError as exc:
        raise SandboxUnavailable(f"cannot reach NATS at {natsusers.redacted(nats_url)} for the sandbox service "
                                 f"({exc}): {NO_SERVICE}") from exc
    return bus, SandboxClient(bus)


async def default_client() -> SandboxClient:
    """The client of :func:`use_client`, else this process's own, connected on first use (per
    event loop) to setting ``nats_url`` (``FLYWHEEL_NATS_URL``)."""
    given = _current.get()
    if given is not None:
        return given
    from flywheel.contract.settings import Settings

    loop = asyncio.get_running_loop()
    pending = _connected.get(loop)
    if pending is None or (pending.done() and pending.exception() is not None):  # a failed connect is tried again
        pending = loop.create_task(connect(Settings.load().resolved_nats_url, CONNECT_TIMEOUT_S))
        _connected[loop] = pending
    _, client = await asyncio.shield(pending)
    return client


# --- unit tests in a one-shot sandbox -------------------------------------------------------


@dataclass(frozen=True)
class TestReport:
    """What a test run gave: per-test verdicts (``pass``, ``fail``, ``timeout``, ``missing``:
    the run ended before the test said anything), and how the run itself ended."""

    __test__ = False  # not a pytest class

    verdicts: dict[str, str]
    exit_code: int
    timed_out: bool  # the whole run hit its timeout
    output: str  # the tail of stdout and stderr (for logs, not parsed)
    failures: dict[str, str] = field(default_factory=dict)  # test -> why

    @property
    def num_tests(self) -> int:
        return len(self.verdicts)

    @property
    def num_passed(self) -> int:
        return sum(1 for v in self.verdicts.values() if v == "pass")

    @property
    def fraction(self) -> float:
        return self.num_passed / self.num_tests if self.verdicts else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.verdicts) and self.num_passed == self.num_tests

    @property
    def num_timeouts(self) -> int:
        return sum(1 for v in self.verdicts.values() if v == "timeout")


def runner_source() -> str:
    return (Path(__file__).parent / "sandbox_test_runner.py").read_text()


_PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|errors?)\b")


def read_verdicts(output: str, nonce: str, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The runner's verdicts on ``names`` from its output (lines starting with ``nonce``); a
    test with no verdict is ``missing``, a name it was not asked about is ignored."""
    verdicts = dict.fromkeys(names, "missing")
    failures: dict[str, str] = {}
    for line in output.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == nonce and parts[2] in verdicts and verdicts[parts[2]] == "missing":
            verdicts[parts[2]] = parts[1]
            if parts[1] != "pass":
                failures[parts[2]] = parts[3].strip() if len(parts) > 3 else parts[1]
    for name, verdict in verdicts.items():
        if verdict == "missing":
            failures[name] = "no verdict: the run ended before this test reported"
    return verdicts, failures


def command_verdicts(result: ExecResult) -> dict[str, str]:
    """Verdicts of a test command of your own: pytest's summary counts when its output has one,
    else the command is one test that passes when it exits 0."""
    counts = {"passed": 0, "failed": 0}
    found = False
    for number, kind in _PYTEST_COUNTS.findall(result.stdout + "\n" + result.stderr):
        found = True
        counts["passed" if kind == "passed" else "failed"] += int(number)
    if not found:
        ok = result.exit_code == 0 and not result.timed_out
        return {"command": "pass" if ok else "timeout" if result.timed_out else "fail"}
    return {f"passed_{i}": "pass" for i in range(counts["passed"])} | {
        f"failed_{i}": "timeout" if result.timed_out else "fail" for i in range(counts["failed"])}


async def run_tests(files: Mapping[str, str | bytes], test_file: str = "test_solution.py", *,
                    command: str | list[str] | None = None, client: SandboxClient | None = None,
                    spec: SandboxSpec | None = None, timeout_s: float = 30.0,
                    test_timeout_s: float = 5.0, python_executable: str = "python3") -> TestReport:
    """Run unit tests on ``files`` (path -> source, the tests among them) in a one-shot sandbox.

    By default ``test_file``'s top-level ``test_*`` functions run under
    :mod:`flywheel.sdk.sandbox_test_runner`, each with ``test_timeout_s``, the whole run with
    ``timeout_s``. ``command`` runs a test command of your own instead (e.g. ``pytest -q`` in
    an image that has it; see :func:`command_verdicts`). A service failure raises
    :class:`SandboxUnavailable` (a reward error, never a silent zero)."""
    client = client or await default_client()
    written = {path: (data.encode() if isinstance(data, str) else data) for path, data in files.items()}
    nonce = secrets.token_hex(12)
    names: list[str] = []
    if command is None:
        if test_file not in written:
            raise ValueError(f"run_tests: {test_file!r} is not among the files ({sorted(written)})")
        try:
            names = collect_tests(written[test_file].decode())
        except SyntaxError as exc:
            raise ValueError(f"run_tests: the test file {test_file!r} does not parse: {exc}") from exc
        if not names:
            raise ValueError(f"run_tests: {test_file!r} has no top-level test_* function")
        written[RUNNER_FILE] = runner_source().encode()
        command = [python_executable, RUNNER_FILE, test_file]
    spec = spec or SandboxSpec()
    spec = msgspec.structs.replace(spec, env={**spec.env, "FLYWHEEL_TEST_TIMEOUT_S": f"{test_timeout_s:g}"})
    try:
        # Only the runner gets stdin (the nonce): a command of yours may exit without reading it.
        result = await when_there_is_room(functools.partial(
            client.run, command, files=written, spec=spec, stdin=nonce + "\n" if names else "", timeout_s=timeout_s))
    except SandboxError as exc:
        if exc.kind in SERVICE_FAILURES:
            raise service_unavailable(exc) from exc
        raise
    output = (result.stdout[-2000:] + ("\n" + result.stderr[-2000:] if result.stderr else "")).strip()
    if names:
        verdicts, failures = read_verdicts(result.stdout, nonce, names)
    else:
        verdicts = command_verdicts(result)
        failures = {k: "failed" for k, v in verdicts.items() if v != "pass"}
    if result.timed_out:
        for name, verdict in verdicts.items():
            if verdict == "missing":
                verdicts[name] = "timeout"
                failures[name] = f"the whole run passed timeout_s={timeout_s:g}"
    return TestReport(verdicts=verdicts, exit_code=result.exit_code, timed_out=result.timed_out, output=output,
                      failures=failures)
