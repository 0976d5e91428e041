"""Local processes kept running: what ``flywheel up`` and a run's orchestrator share.

A :class:`ServiceProcess` is one child (its command, log file, environment and health check,
forked from the fork server where there is one: :mod:`flywheel.runtime.forkserver`); a
:class:`RestartBackoff` says how long to wait before starting again one that exited. The
supervisors are :class:`flywheel.ops.stack.Stack` (every service of ``flywheel up``) and the
orchestrator's run owner (a run's trainer). Children get the supervisor's settings as
``FLYWHEEL_*`` variables (:func:`child_env`), each with its own NATS login
(:func:`trainer_env` for a run's trainer).
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flywheel.contract import events, natsusers
from flywheel.contract.bus import wait_at_most
from flywheel.contract.retry import Backoff
from flywheel.contract.service import HEARTBEAT_INTERVAL_S
from flywheel.contract.settings import SECTIONS, Settings
from flywheel.runtime import forkserver

if TYPE_CHECKING:
    from flywheel.contract.bus import Bus


class Supervisor(Protocol):
    """What a health check may ask of the supervisor that runs it."""

    bus: Bus | None

    async def heartbeats(self) -> list[events.ServiceHeartbeat]:
        """The services' latest heartbeats (from the services KV bucket)."""
        ...


# A health check answers None when healthy, else why not (shown when start-up times out).
HealthCheck = Callable[["Supervisor", "Process"], Awaitable[str | None]]


@dataclass(frozen=True)
class ServiceSpec:
    """A service that runs as a local process: its command (after the Python interpreter)
    and how the stack knows it is healthy."""

    argv: tuple[str, ...]
    health: HealthCheck
    # Added to the process's nice value: the gateway's processes record and answer queries;
    # they are off a training step's path (sampling, scoring, training), so on a machine of a
    # few cores they yield the CPU to it, at start-up (model loads) as in every step.
    nice: int = 0
    # The fork server's level it is forked from (flywheel.runtime.forkserver): "base", or "torch" for
    # a service that imports torch; None: always its own interpreter.
    fork_level: str | None = "base"


HEARTBEAT_STALE_S = 4 * HEARTBEAT_INTERVAL_S  # a heartbeat older than this: the process's loop is stuck
HEALTH_CHECK_TIMEOUT_S = 10.0


def heartbeat_of(service: str) -> HealthCheck:
    """Healthy while the services KV bucket holds an ``ok`` heartbeat from this very process, renewed
    within the last HEARTBEAT_STALE_S (a process whose event loop is blocked renews none)."""

    async def check(stack: Supervisor, process: Process) -> str | None:
        assert stack.bus is not None
        beats = [b for b in await stack.heartbeats()
                 if b.service == service and b.pid == process.pid and b.status == "ok"]
        if not beats:
            return f"no heartbeat from {service} pid {process.pid} in the services KV bucket yet"
        age_s = (events.utc_now() - max(b.updated_at for b in beats)).total_seconds()
        if age_s > HEARTBEAT_STALE_S:
            return f"its last heartbeat is {age_s:.0f}s old (its event loop is blocked?)"
        return None

    return check


class ProcessDied(Exception):
    """A process exited while the stack waited for it to become healthy."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"exited with {exit_text(returncode)}")
        self.returncode = returncode


class NotHealthy(Exception):
    """A process still runs but is not healthy after ``start_timeout_s``; the message says why."""

    def __init__(self, timeout_s: float, problem: str) -> None:
        super().__init__(f"not healthy after {timeout_s:g}s ({problem})")


PROCESS_RESTART = Backoff(first_s=1.0, max_s=60.0)  # a process's restarts in a crash loop, by default


@dataclass
class RestartBackoff:
    """How long to wait before starting again a process that exited.

    A process that had stayed healthy ``healthy_after_s`` is started again at once: killed
    now and then after running fine, it is back within a second. Each further exit in a row
    before that (a crash loop) waits as ``schedule`` says (by default 1 s, then twice as long
    each time, up to 60 s); an exit after a healthy stretch resets the count. One per process::

        backoff = RestartBackoff(Backoff(first_s=1.0, max_s=60.0), healthy_after_s=30.0)
        delay_s = backoff.after_exit(healthy_for_s)  # 0, 1, 2, 4, ... 60, 60; 0 again after 30s healthy
    """

    schedule: Backoff = PROCESS_RESTART
    healthy_after_s: float = 30.0
    num_failures: int = 0  # exits in a row without a healthy stretch in between, the latest included
    delay_s: float = 0.0  # the wait chosen at the latest exit

    def after_exit(self, healthy_for_s: float) -> float:
        """Count an exit of a process that had been healthy for ``healthy_for_s`` (0 when it
        never became healthy) and return how long to wait before starting it again."""
        if healthy_for_s >= self.healthy_after_s:
            self.num_failures = 0
        self.delay_s = 0.0 if self.num_failures == 0 else self.schedule.delay_s(self.num_failures)
        self.num_failures += 1
        return self.delay_s


def exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"


def tail(path: Path, offset: int = 0, num_lines: int = 40) -> str:
    """The last lines of ``path`` written after byte ``offset``."""
    if not path.exists():
        return "(no log written)"
    with path.open("rb") as f:
        f.seek(max(offset, path.stat().st_size - 64 * 1024))
        lines = f.read().decode(errors="replace").splitlines()[-num_lines:]
    return "\n".join(f"  | {line}" for line in lines) or "(log is empty)"


class Process(abc.ABC):
    """One process the stack started, with its health check; base of the two kinds below.

    It also holds what the supervisor knows of it, for its screen and ``flywheel status``:
    ``state`` is ``not started``, ``starting`` (first start, not healthy yet), ``running``
    (healthy), ``backing off`` (exited; next start at ``next_start_at``), ``restarting``
    (started again, not healthy yet), ``waiting`` (unhealthy for a reason a restart does not
    cure: a full disk; ``problem`` says which) or ``stopped``.

    Its health check may also say what cures a failure, in ``cure``: ``"restart"`` (at once:
    a store that failed is cleared by a restart, and space is back) or ``"wait"`` (a restart
    would not help: the supervisor waits, saying why, and never counts it as unhealthy time).
    """

    name: str
    log_path: Path

    def __init__(self) -> None:
        self.log_offset = 0  # where this start's lines begin in the log
        self.state = "not started"
        self.last_pid: int | None = None  # of the latest start, alive or not
        self.num_restarts = 0
        self.backoff = RestartBackoff()  # the stack sets its own policy
        self.last_exit: str | None = None  # "code 3", "signal SIGKILL", "not healthy", "did not start"
        self.last_exit_at: datetime | None = None
        self.healthy_at: float | None = None  # monotonic time this start became healthy
        self.healthy_since: datetime | None = None
        self.next_start_at: datetime | None = None
        self.cure: str | None = None  # set by a failing health check: "restart", "wait", or None
        self.problem: str | None = None  # why it waits (state "waiting"), for the screen and flywheel status

    @property
    @abc.abstractmethod
    def pid(self) -> int:
        """The process id of the current start."""

    @abc.abstractmethod
    def returncode(self) -> int | None:
        """None while running, else the exit status."""

    @abc.abstractmethod
    async def launch(self) -> None:
        """Start the process (it may not be healthy yet)."""

    @abc.abstractmethod
    async def health(self, stack: Supervisor) -> str | None:
        """None when healthy, else why not."""

    @abc.abstractmethod
    async def stop(self, timeout_s: float) -> None:
        """Stop it (SIGTERM, SIGKILL after ``timeout_s``) if it runs."""

    def log_tail(self) -> str:
        return f"last lines of {self.log_path}:\n{tail(self.log_path, self.log_offset)}"

    def _mark_log(self) -> None:
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0

    def view(self) -> dict[str, Any]:
        """What ``flywheel status`` shows of it (plain data; times in UTC, RFC 3339)."""
        return {"name": self.name, "pid": self.last_pid, "state": self.state, "num_restarts": self.num_restarts,
                "num_failures": self.backoff.num_failures, "backoff_s": self.backoff.delay_s,
                "last_exit": self.last_exit, "last_exit_at": _iso(self.last_exit_at),
                "healthy_since": _iso(self.healthy_since), "next_start_at": _iso(self.next_start_at),
                "problem": self.problem, "log": str(self.log_path)}


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.isoformat()


class ServiceProcess(Process):
    """A service child: its own session (so a terminal's Ctrl-C reaches only the stack,
    which then stops the services in order), its log file, the shared environment. With
    ``fork_from`` (a data folder), forked by that stack's fork server when it has one
    (:mod:`flywheel.runtime.forkserver`), else started as its own interpreter."""

    def __init__(self, name: str, spec: ServiceSpec, env: dict[str, str], log_path: Path,
                 fork_from: Path | None = None) -> None:
        super().__init__()
        self.name = name
        self.spec = spec
        self.env = env
        self.log_path = log_path
        self.fork_from = fork_from
        self.popen: forkserver.Child | None = None

    @property
    def argv(self) -> list[str]:
        return [sys.executable, *self.spec.argv]

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def returncode(self) -> int | None:
        assert self.popen is not None
        return self.popen.poll()

    async def launch(self) -> None:
        self._mark_log()
        with self.log_path.open("ab") as log:
            log.write(f"--- flywheel up: {' '.join(self.argv)}\n".encode())
        # The supervisor needs a Popen-like child (poll, signals to its group), not asyncio's Process.
        level = self.spec.fork_level
        fork = None if self.fork_from is None or level is None else (self.fork_from, level)
        self.popen = await forkserver.launch(list(self.spec.argv), self.env, self.log_path, fork)
        self.last_pid = self.popen.pid
        if self.spec.nice and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, self.popen.pid, os.getpriority(os.PRIO_PROCESS, 0) + self.spec.nice)
            except OSError:  # gone already, or not allowed here: it runs at our priority
                pass

    async def health(self, stack: Supervisor) -> str | None:
        return await self.spec.health(stack, self)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM to the service's process group (it and what it spawned), SIGKILL after
        ``timeout_s``. Only while the service itself is alive: its group is ours then."""
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.popen.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(self.popen.pid, signal.SIGKILL)
                await asyncio.to_thread(self.popen.wait)
                break
            await asyncio.sleep(0.05)


def child_env(settings: Settings) -> dict[str, str]:
    """This environment plus every setting as ``FLYWHEEL_*``, resolved (absolute data folder,
    concrete NATS, database and gateway URLs), so every child reads the same values; a
    section's fields as ``FLYWHEEL_<SECTION>__<FIELD>`` (JSON values, text as it is)."""
    values = settings.model_dump(mode="json", exclude=set(SECTIONS)) | {
        "data_dir": str(settings.data_dir.resolve()),
        # The server, not the login: a child logs in as its own user (nats_user, nats_password).
        "nats_url": settings.nats_server_url,
        "database_url": settings.resolved_database_url,
        "gateway_url": settings.resolved_gateway_url,
    }
    env = dict(os.environ)
    # A list (trusted_modules) as JSON, which is how it is read back; the rest as text.
    env.update({f"FLYWHEEL_{name.upper()}": json.dumps(value) if isinstance(value, list) else str(value)
                for name, value in values.items() if value is not None})
    for section in SECTIONS:
        fields = getattr(settings, section).model_dump(mode="json")
        # Text as it is (a text field is read verbatim, so JSON quotes would stay in it), the rest as JSON.
        # Unset (None) stays unset: "null" would be read back as the text (a path named "null").
        env.update({f"FLYWHEEL_{section.upper()}__{name.upper()}": value if isinstance(value, str)
                    else json.dumps(value) for name, value in fields.items() if value is not None})
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they are written
    if settings.torch_threads is not None:
        # Also for the BLAS pools torch starts before it reads the setting.
        env.setdefault("OMP_NUM_THREADS", str(settings.torch_threads))
    return env


def login_env(user: str, password: str) -> dict[str, str]:
    """The environment of a child logging in to NATS as ``user``."""
    return {"FLYWHEEL_NATS_USER": user, "FLYWHEEL_NATS_PASSWORD": password}


def trainer_env(settings: Settings) -> dict[str, str]:
    """:func:`child_env` for a run's trainer, started by an orchestrator with ``settings``: logged in
    as NATS user ``trainer`` (``nats_trainer_password``), never with the orchestrator's own login
    (no password of it, nor that of the trainer's, is left in the environment but this one). A
    ValueError when the orchestrator logs in as a user and has no trainer password to give."""
    env = {k: v for k, v in child_env(settings).items() if not k.startswith("FLYWHEEL_NATS_")}
    env["FLYWHEEL_NATS_URL"] = natsusers.split_login(settings.nats_server_url)[0]
    for name in ("nats_port", "nats_cluster"):
        env[f"FLYWHEEL_{name.upper()}"] = str(getattr(settings, name))
    if settings.nats_trainer_password:
        return env | login_env(natsusers.TRAINER, settings.nats_trainer_password)
    if natsusers.split_login(settings.resolved_nats_url)[1] is not None:
        raise ValueError("set nats_trainer_password (FLYWHEEL_NATS_TRAINER_PASSWORD; in compose/.env "
                         f"{natsusers.password_variable(natsusers.TRAINER)}): the orchestrator logs in to NATS as a "
                         "user, and the trainers it starts log in as user 'trainer', never with its own login")
    return env


def metrics_port(settings: Settings, index: int) -> dict[str, str]:
    """The environment that gives the ``index``-th service of a stack its own metrics port:
    ``metrics_port`` plus ``index`` (0 stays 0: each picks a free one); nothing when unset."""
    if settings.metrics_port is None:
        return {}
    return {"FLYWHEEL_METRICS_PORT": str(settings.metrics_port and settings.metrics_port + index)}


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; True when it is set."""
    return await wait_at_most(event.wait(), timeout_s) is not None


