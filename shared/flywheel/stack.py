"""The embedded stack behind ``flywheel up``: NATS and every service as local processes.

Why: one command gives a working Flywheel on one machine, with the same processes, events
and settings a deployment uses; only where they run differs.

What it does, in order:

1. refuses to start when a port it needs is taken, naming the setting to change;
2. starts a nats-server with JetStream (store in ``<data_dir>/nats``, port ``nats_port``)
   unless ``nats_url`` names an existing server, which is then used as it is;
3. starts each service of :data:`SERVICES` in order (the gateway first: it runs the
   database migrations) and waits until it is healthy, within ``start_timeout_s``; a service
   that dies or stays unhealthy stops the stack with the tail of its log;
4. supervises: a process that exits unexpectedly is reported and restarted with backoff
   (doubling from ``restart_backoff_s``), at most ``max_restarts`` times within
   ``restart_window_s``, after which the stack stops with the tail of its log;
5. on SIGINT or SIGTERM stops the services in reverse order (SIGTERM, then SIGKILL after
   ``stop_timeout_s``), then the nats-server it started: only the processes it started.

Every child gets the same ``FLYWHEEL_*`` environment (NATS URL, database URL, data folder,
ports), so they agree with each other and with ``flywheel status``. Each writes its log to
``<data_dir>/logs/<name>.log``.

Not covered: several replicas of a service (deploy with compose/ for that), services on
other machines, and cleaning up after ``flywheel up`` itself is killed with SIGKILL (its
children then keep running; stop them by the pids it printed).
"""

from __future__ import annotations

import abc
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import nats.errors

from flywheel.bus import Bus
from flywheel.natsserver import NatsServer, die_with_parent, port_open
from flywheel.service import read_heartbeats
from flywheel.settings import Settings


class StackError(Exception):
    """The stack cannot start or keep running; the message says why and what to change."""


# A health check answers None when healthy, else why not (shown when start-up times out).
HealthCheck = Callable[["Stack", "Process"], Awaitable[str | None]]


@dataclass(frozen=True)
class ServiceSpec:
    """A service that runs as a local process: its command (after the Python interpreter)
    and how the stack knows it is healthy."""

    argv: tuple[str, ...]
    health: HealthCheck


async def gateway_health(url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """``GET <url>/healthz`` as plain data: ``ok`` is True on 200; ``error`` when unreachable."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            response = await http.get(f"{url.rstrip('/')}/healthz")
    except httpx.HTTPError as exc:
        return {"url": url, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    is_json = response.headers.get("content-type", "").startswith("application/json")
    return {"url": url, "ok": response.status_code == 200, "status_code": response.status_code,
            "detail": response.json() if is_json else response.text[:500]}


async def _gateway_healthy(stack: Stack, process: Process) -> str | None:
    health = await gateway_health(stack.local_gateway_url)
    if health["ok"]:
        return None
    answer = health.get("error") or f"HTTP {health['status_code']}: {health['detail']}"
    return f"GET {health['url']}/healthz: {answer}"


def heartbeat_of(service: str) -> HealthCheck:
    """Healthy once the services KV bucket holds an ``ok`` heartbeat from this very process."""

    async def check(stack: Stack, process: Process) -> str | None:
        assert stack.bus is not None
        beats = await read_heartbeats(stack.bus)
        if any(b.service == service and b.pid == process.pid and b.status == "ok" for b in beats):
            return None
        return f"no heartbeat from {service} pid {process.pid} in the services KV bucket yet"

    return check


# Every service that runs as a local process, in start order (the gateway runs the migrations).
SERVICES: dict[str, ServiceSpec] = {
    "gateway": ServiceSpec(("-m", "flywheel_gateway", "api"), _gateway_healthy),
    "recorder": ServiceSpec(("-m", "flywheel_gateway", "recorder"), heartbeat_of("recorder")),
    "scorer": ServiceSpec(("-m", "flywheel_scorer"), heartbeat_of("scorer")),
    "sandbox": ServiceSpec(("-m", "flywheel_sandbox"), heartbeat_of("sandbox")),
    "inference": ServiceSpec(("-m", "flywheel_inference"), heartbeat_of("inference")),
}


class ProcessDied(Exception):
    """A process exited while the stack waited for it to become healthy."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"exited with {exit_text(returncode)}")
        self.returncode = returncode


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
    """One process the stack started, with its health check; base of the two kinds below."""

    name: str
    log_path: Path

    def __init__(self) -> None:
        self.restarts: deque[float] = deque()  # monotonic times of recent restarts
        self.log_offset = 0  # where this start's lines begin in the log

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
    async def health(self, stack: Stack) -> str | None:
        """None when healthy, else why not."""

    @abc.abstractmethod
    async def stop(self, timeout_s: float) -> None:
        """Stop it (SIGTERM, SIGKILL after ``timeout_s``) if it runs."""

    def log_tail(self) -> str:
        return f"last lines of {self.log_path}:\n{tail(self.log_path, self.log_offset)}"

    def _mark_log(self) -> None:
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0


class NatsProcess(Process):
    """The nats-server the stack started (a :class:`flywheel.natsserver.NatsServer`)."""

    def __init__(self, server: NatsServer) -> None:
        super().__init__()
        self.name = "nats-server"
        self.server = server
        self.log_path = server.log_file

    @property
    def pid(self) -> int:
        assert self.server.process is not None
        return self.server.process.pid

    def returncode(self) -> int | None:
        assert self.server.process is not None
        return self.server.process.poll()

    async def launch(self) -> None:
        self._mark_log()
        try:
            await asyncio.to_thread(self.server.start)
        except (RuntimeError, TimeoutError) as exc:
            raise StackError(f"nats-server did not start: {exc}\n{self.log_tail()}") from exc

    async def health(self, stack: Stack) -> str | None:
        return None  # start() returns once it listens

    async def stop(self, timeout_s: float) -> None:
        await asyncio.to_thread(self.server.stop, timeout_s)


class ServiceProcess(Process):
    """A service child: its own session (so a terminal's Ctrl-C reaches only the stack,
    which then stops the services in order), its log file, the shared environment."""

    def __init__(self, name: str, spec: ServiceSpec, env: dict[str, str], log_path: Path) -> None:
        super().__init__()
        self.name = name
        self.spec = spec
        self.env = env
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

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
            log.flush()
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env, start_new_session=True, preexec_fn=die_with_parent)

    async def health(self, stack: Stack) -> str | None:
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
    concrete NATS, database and gateway URLs), so every child reads the same values."""
    values = settings.model_dump(mode="json") | {
        "data_dir": str(settings.data_dir.resolve()),
        "nats_url": settings.resolved_nats_url,
        "database_url": settings.resolved_database_url,
        "gateway_url": settings.resolved_gateway_url,
    }
    env = dict(os.environ)
    env.update({f"FLYWHEEL_{name.upper()}": str(value) for name, value in values.items() if value is not None})
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they are written
    if settings.torch_threads is not None:
        # Also for the BLAS pools torch starts before it reads the setting.
        env.setdefault("OMP_NUM_THREADS", str(settings.torch_threads))
    return env


def local_host(host: str) -> str:
    """Where this machine reaches a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def check_ports(settings: Settings) -> None:
    """Raise StackError naming the setting to change when a port the stack needs is taken."""
    problems = []
    if settings.nats_url is None:
        if settings.nats_port == settings.gateway_port:
            problems.append(f"nats_port and gateway_port are both {settings.nats_port}; change one "
                            "(--nats-port / FLYWHEEL_NATS_PORT or --gateway-port / FLYWHEEL_GATEWAY_PORT)")
        elif port_open("127.0.0.1", settings.nats_port):
            problems.append(f"port {settings.nats_port} (nats_port) is taken: choose a free one with --nats-port / "
                            "FLYWHEEL_NATS_PORT, or use the NATS server there with --nats-url / FLYWHEEL_NATS_URL")
    if port_open(local_host(settings.inference_host), settings.inference_port):
        problems.append(f"port {settings.inference_port} (inference_port) is taken: choose a free one with "
                        "--inference-port / FLYWHEEL_INFERENCE_PORT")
    if port_open(local_host(settings.gateway_host), settings.gateway_port):
        problems.append(f"port {settings.gateway_port} (gateway_port) is taken: choose a free one with "
                        "--gateway-port / FLYWHEEL_GATEWAY_PORT")
    if problems:
        raise StackError("cannot start the stack:\n  " + "\n  ".join(problems))


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; True when it is set."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


class Stack:
    """Starts, supervises and stops the embedded stack. ``await run()`` until a signal."""

    def __init__(
        self,
        settings: Settings,
        out: TextIO = sys.stdout,
        services: dict[str, ServiceSpec] | None = None,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 15.0,
        max_restarts: int = 5,
        restart_window_s: float = 600.0,
        restart_backoff_s: float = 1.0,
        poll_interval_s: float = 0.25,
    ) -> None:
        self.settings = settings
        self.out = out
        self.data_dir = settings.data_dir.resolve()
        self.log_dir = self.data_dir / "logs"
        self.nats_url = settings.resolved_nats_url
        self.local_gateway_url = f"http://{local_host(settings.gateway_host)}:{settings.gateway_port}"
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restart_backoff_s = restart_backoff_s
        self.poll_interval_s = poll_interval_s
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once everything started is healthy
        self.bus: Bus | None = None
        self.nats: NatsProcess | None = None
        env = child_env(settings)
        self.services = [ServiceProcess(name, spec, env, self.log_dir / f"{name}.log")
                         for name, spec in (SERVICES if services is None else services).items()]
        self.started: list[Process] = []  # in start order; stopped in reverse

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    async def run(self) -> None:
        """Start everything, supervise until SIGINT/SIGTERM, then stop what was started.

        Raises StackError when start-up fails or a process keeps dying (after stopping the rest).
        """
        check_ports(self.settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            await self._start()
            if not self.stopping.is_set():
                self._say_ready()
                self.ready.set()
                await self._supervise()
        finally:
            await self._shutdown()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.settings.nats_url is None:
            server = NatsServer(self.data_dir / "nats", port=self.settings.nats_port,
                                log_file=self.log_dir / "nats-server.log")
            self.nats = NatsProcess(server)
            await self.nats.launch()
            self.started.append(self.nats)
            self.say(f"started nats-server (pid {self.nats.pid}) on {self.nats_url}, store {server.store_dir}")
        else:
            self.say(f"using the NATS server at {self.nats_url} (nats_url)")
        self.bus = await Bus.connect(self.nats_url, name="flywheel-up")
        for service in self.services:
            if self.stopping.is_set():
                return
            try:
                await self._launch_healthy(service)
            except ProcessDied as exc:
                raise StackError(f"{service.name} {exc} during start-up; {service.log_tail()}") from exc

    async def _launch_healthy(self, process: Process) -> None:
        """Launch and wait until healthy (or until a stop is asked). Raises ProcessDied, or
        StackError when it is still unhealthy after ``start_timeout_s``."""
        began = time.monotonic()
        await process.launch()
        if process not in self.started:
            self.started.append(process)
        self.say(f"started {process.name} (pid {process.pid}), log {process.log_path}")
        while True:
            returncode = process.returncode()
            if returncode is not None:
                raise ProcessDied(returncode)
            try:
                problem = await process.health(self)
            except nats.errors.Error as exc:  # NATS restarting: not healthy yet, say so on timeout
                problem = f"health check failed: {type(exc).__name__}: {exc}"
            if problem is None:
                self.say(f"{process.name} is healthy ({time.monotonic() - began:.1f}s)")
                return
            if time.monotonic() - began > self.start_timeout_s:
                raise StackError(f"{process.name} (pid {process.pid}) is not healthy after {self.start_timeout_s:g}s "
                                 f"({problem}); {process.log_tail()}")
            if await _wait(self.stopping, self.poll_interval_s):
                return

    def _say_ready(self) -> None:
        gateway = self.settings.resolved_gateway_url
        nats_owner = f"pid {self.nats.pid}" if self.nats else "existing server"
        self.say("\n".join([
            "Flywheel is up. Ctrl-C stops it.",
            f"  gateway   {gateway}",
            f"  API docs  {gateway}/docs",
            f"  NATS      {self.nats_url} ({nats_owner})",
            f"  data      {self.data_dir}",
            f"  logs      {self.log_dir}",
        ]))

    async def _supervise(self) -> None:
        while not self.stopping.is_set():
            for process in self.started:
                returncode = process.returncode()
                if returncode is not None:
                    await self._restart(process, returncode)
                    if self.stopping.is_set():
                        return
            await _wait(self.stopping, self.poll_interval_s)

    async def _restart(self, process: Process, returncode: int) -> None:
        """Restart with backoff until healthy; StackError once the restart budget is spent."""
        while True:
            now = time.monotonic()
            while process.restarts and now - process.restarts[0] > self.restart_window_s:
                process.restarts.popleft()
            if len(process.restarts) >= self.max_restarts:
                raise StackError(f"{process.name} exited with {exit_text(returncode)}; it was restarted "
                                 f"{self.max_restarts} times within {self.restart_window_s:g}s, giving up; "
                                 f"{process.log_tail()}")
            process.restarts.append(now)
            delay_s = min(self.restart_backoff_s * 2.0 ** (len(process.restarts) - 1), 30.0)
            self.say(f"{process.name} (pid {process.pid}) exited unexpectedly with {exit_text(returncode)}; "
                     f"restarting in {delay_s:g}s (restart {len(process.restarts)} of at most "
                     f"{self.max_restarts} within {self.restart_window_s:g}s); {process.log_tail()}")
            if await _wait(self.stopping, delay_s):
                return
            try:
                await self._launch_healthy(process)
                return
            except ProcessDied as exc:
                returncode = exc.returncode

    async def _shutdown(self) -> None:
        services = [p for p in self.started if p is not self.nats]
        if self.started:
            self.say("stopping: " + ", ".join(p.name for p in reversed(self.started)))
        try:
            for process in reversed(services):
                await process.stop(self.stop_timeout_s)
                self.say(f"stopped {process.name}")
            if self.bus is not None:
                await self._close_bus(self.bus)
        finally:  # the server goes last, and whatever happened above
            if self.nats is not None and self.nats in self.started:
                await self.nats.stop(self.stop_timeout_s)
                self.say("stopped nats-server")

    async def _close_bus(self, bus: Bus) -> None:
        try:
            await asyncio.wait_for(bus.close(), self.stop_timeout_s)
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            # NATS is gone or going: the connection has nothing left to flush.
            self.say(f"closing the NATS connection: {type(exc).__name__}: {exc}")
            await bus.nc.close()


def run(settings: Settings, out: TextIO = sys.stdout) -> None:
    """Run the embedded stack in the foreground until SIGINT or SIGTERM."""
    asyncio.run(Stack(settings, out).run())
