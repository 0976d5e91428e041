"""The embedded stack behind ``flywheel up``: NATS and every service as local processes.

Why: one command gives a working Flywheel on one machine, with the same processes, events
and settings a deployment uses; only where they run differs.

What it does, in order:

1. takes the data folder (:class:`DataFolderLock`: one stack a folder, so a second ``flywheel
   up`` on it is refused, naming the first one's pid and ports, before it can open the live
   JetStream store or the fork server's sockets), and refuses to start when a port it needs
   is taken, naming the setting to change;
2. starts the fork server (setting ``fork_services``, :mod:`flywheel.runtime.forkserver`): the
   services, and the trainer of a run the orchestrator starts, are forks of it, their
   packages imported once while the rest starts;
3. starts a nats-server with JetStream (store in ``<data_dir>/nats``, port ``nats_port``)
   unless ``nats_url`` names an existing server, which is then used as it is;
4. starts each service of :data:`SERVICES` in order (the gateway first: it runs the
   database migrations) and waits until it is healthy, within ``start_timeout_s``; a service
   that dies or stays unhealthy stops the stack with the tail of its log: at start-up that
   is a configuration error to show at once;
5. supervises, never giving up: a process that exits, or whose health check fails for
   ``unhealthy_after_s`` while it runs (a blocked event loop renews no heartbeat; a JetStream
   store that failed on a full disk refuses every request), or, restarted, stays unhealthy, is
   reported with the tail of its log and started again, while the rest keep serving. A
   process that had stayed healthy ``healthy_after_s`` is restarted at once, so a run it
   serves recovers fast; exits in a row before that (a crash loop: a message that crashes
   inference each time it is redelivered) wait ``restart_backoff_s``, then twice as long
   each time, up to ``max_backoff_s`` (:class:`RestartBackoff`). One failing service never
   stops the bus or the others;
6. publishes its view, every process with its pid, state, restarts, last exit, next try
   and log, as the ``info`` of a heartbeat of its own (service ``stack`` in the services KV
   bucket), renewed at each change: ``flywheel status`` shows it;
7. on SIGINT or SIGTERM stops the services in reverse order (SIGTERM, then SIGKILL after
   ``stop_timeout_s``), removes its heartbeat, then stops the fork server and the
   nats-server it started: only the processes it started.

Every child gets the same ``FLYWHEEL_*`` environment (NATS URL, database URL, data folder,
ports), so they agree with each other and with ``flywheel status``, and its own NATS login
(:mod:`flywheel.contract.natsusers`: the stack alone, which makes the streams, is the operator).
Each writes its log to ``<data_dir>/logs/<name>.log``.

Not covered: several replicas of a service (deploy with compose/ for that), services on
other machines. A SIGKILL of ``flywheel up`` itself reaches its children as SIGTERM on Linux
(the parent-death signal, :func:`flywheel.runtime.natsserver.die_with_parent`); elsewhere they
keep running: stop them by the pids it printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Collection
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import nats.errors
import nats.js.errors

from flywheel.contract import events, natsusers
from flywheel.contract.bus import Bus, BusConfig
from flywheel.contract.retry import Backoff
from flywheel.contract.service import Service, read_heartbeats
from flywheel.contract.settings import Settings
from flywheel.runtime import forkserver
from flywheel.runtime.natsserver import MIN_FREE_MIB, STORE_FAILED_MARK, NatsCluster, NatsServer, free_mib, port_open
from flywheel.runtime.supervise import (
    HEALTH_CHECK_TIMEOUT_S,
    NotHealthy,
    Process,
    ProcessDied,
    RestartBackoff,
    ServiceProcess,
    ServiceSpec,
    Supervisor,
    child_env,
    exit_text,
    heartbeat_of,
    login_env,
    metrics_port,
    wait_set,
)
from flywheel.sdk import gateway

# The service name of the stack's own heartbeat, whose info is its view of the processes.
STACK_SERVICE = "stack"


class StackError(Exception):
    """The stack cannot start or keep running; the message says why and what to change."""


class DataFolderLock:
    """One stack a data folder at a time: an exclusive ``flock`` on ``<data_dir>/flywheel-up.lock``,
    held while the stack runs (the system lets go of it when the process ends, however it
    ends), whose text says who holds it (pid, ports, since when, the nats-server it started).
    A nats-server an earlier holder started that still runs (its holder killed, the server not
    yet stopped) keeps the folder taken too: two servers on one JetStream store lose messages."""

    FILE = "flywheel-up.lock"

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / self.FILE
        self._fd: int | None = None
        self.about: dict[str, Any] = {}

    def acquire(self, about: dict[str, Any]) -> None:
        """Take the folder; StackError naming the holder when another stack has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StackError(f"the data folder {self.path.parent} is in use by another stack ({self._holder()}); stop "
                             "that one first (Ctrl-C where it runs, or `kill PID`), or give this one a folder of its "
                             "own (--data-dir)") from None
        previous = self._read(fd)
        leftover = [pid for pid in previous.get("nats_pids", []) if _runs_nats_server(pid)]
        if leftover:
            os.close(fd)
            raise StackError(f"the nats-server of the stack that last ran on {self.path.parent} (pid "
                             f"{', '.join(map(str, leftover))}) is still running on its JetStream store; wait for it "
                             "to stop, or stop it (`kill PID`), then start again")
        self._fd = fd
        self.update(about)

    def update(self, about: dict[str, Any]) -> None:
        """Say more about the holder (the nats-server's pids once started)."""
        if self._fd is None:
            return
        self.about |= about
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(self.about).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # its nats-server is stopped: nothing left to wait for
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def _read(fd: int) -> dict[str, Any]:
        try:
            found = json.loads(os.pread(fd, 65536, 0) or b"{}")
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    def _holder(self) -> str:
        try:
            about = json.loads(self.path.read_bytes() or b"{}")
        except (OSError, ValueError):
            about = {}
        if not isinstance(about, dict) or "pid" not in about:
            return "it did not say which"
        ports = ", ".join(f"{name} port {port}" for name, port in about.get("ports", {}).items())
        return f"pid {about['pid']} ({about.get('command', 'flywheel up')}), {ports}, since {about.get('since', '?')}"


def _runs_nats_server(pid: int) -> bool:
    try:
        return b"nats-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


async def _gateway_healthy(stack: Supervisor, process: Process) -> str | None:
    assert isinstance(stack, Stack), "the gateway runs under flywheel up"
    health = await gateway.health(stack.local_gateway_url)
    if health["ok"]:
        return None
    answer = health.get("error") or f"HTTP {health['status_code']}: {health['detail']}"
    return f"GET {health['url']}/healthz: {answer}"


async def _training_api_healthy(stack: Supervisor, process: Process) -> str | None:
    assert isinstance(stack, Stack), "the training API runs under flywheel up"
    settings = stack.settings
    health = await gateway.health(f"http://{local_host(settings.training_api_host)}:{settings.training_api_port}"
                                  "/api/v1")
    if health["ok"]:
        return None
    return f"GET {health['url']}/healthz: {health.get('error') or 'HTTP ' + str(health['status_code'])}"


# Every service that runs as a local process, in start order (the gateway runs the migrations).
SERVICES: dict[str, ServiceSpec] = {
    "gateway": ServiceSpec(("-m", "flywheel_gateway", "api"), _gateway_healthy, nice=5),
    # Second: a run registered while the rest start gets its trainer (and model load) at once.
    "orchestrator": ServiceSpec(("-m", "flywheel_orchestrator",), heartbeat_of("orchestrator")),
    "recorder": ServiceSpec(("-m", "flywheel_gateway", "recorder"), heartbeat_of("recorder"), nice=5),
    "scorer": ServiceSpec(("-m", "flywheel_scorer"), heartbeat_of("scorer")),
    "sandbox": ServiceSpec(("-m", "flywheel_sandbox"), heartbeat_of("sandbox")),
    "inference": ServiceSpec(("-m", "flywheel_inference"), heartbeat_of("inference"), fork_level="torch"),
}
# Started by `flywheel up --training-api` alone (runs do not use it): the Tinker-compatible API.
TRAINING_API = ServiceSpec(("-m", "flywheel_trainer.tinker_api"), _training_api_healthy, fork_level="torch")


class NatsProcess(Process):
    """The nats-server the stack started (a :class:`flywheel.runtime.natsserver.NatsServer`)."""

    def __init__(self, server: NatsServer) -> None:
        super().__init__()
        self.name = f"nats-server-{server.server_name}" if server.server_name else "nats-server"
        self.server = server
        self.log_path = server.log_file
        self._scanned = 0  # how far the log was read for a store's failure
        self.store_failure: str | None = None  # the log's line, since this start

    @property
    def pid(self) -> int:
        assert self.server.process is not None
        return self.server.process.pid

    def returncode(self) -> int | None:
        assert self.server.process is not None
        return self.server.process.poll()

    async def launch(self) -> None:
        self._mark_log()
        self._scanned = self.log_offset
        self.store_failure = None
        try:
            await asyncio.to_thread(self.server.start)
        except (RuntimeError, TimeoutError) as exc:
            raise StackError(f"{self.name} did not start: {exc}\n{self.log_tail()}") from exc
        self.last_pid = self.pid

    async def health(self, stack: Supervisor) -> str | None:
        """Healthy while JetStream answers and no stream's store failed a write since this start
        (its log says so). A store that failed (a full disk) takes no message until the server
        restarts, even once space is back, while JetStream still answers: with
        ``MIN_FREE_MIB`` free again, the cure is a restart at once; until then, waiting (a
        restart on a full disk cures nothing)."""
        self.cure = None
        self.store_failure = self.store_failure or await asyncio.to_thread(self._store_failed)
        free = free_mib(self.server.store_dir)
        where = f"{free} MiB free where it keeps its store ({self.server.store_dir})"
        if self.store_failure is None:
            if stack.bus is None or not stack.bus.nc.is_connected:
                return None
            try:
                await stack.bus.js.account_info()
                return None
            except nats.js.errors.APIError as exc:
                failure = f"JetStream refuses requests ({exc})"
        else:
            failure = f"a stream's store failed a write ({self.store_failure})"
        if free < MIN_FREE_MIB:
            self.cure = "wait"
            return (f"disk full: {failure}; {where}; free space there: it restarts once {MIN_FREE_MIB} MiB are "
                    "free")
        self.cure = "restart" if self.store_failure is not None else None
        return f"{failure}; {where}"

    def _store_failed(self) -> str | None:
        """The first line of this start's log, past what was read before, that says a stream's
        store failed a write."""
        if not self.log_path.exists():
            return None
        with self.log_path.open("rb") as log:
            log.seek(self._scanned)
            new = log.read()
        end = new.rfind(b"\n") + 1  # a line still being written is read whole next time
        self._scanned += end
        for line in new[:end].decode(errors="replace").splitlines():
            if STORE_FAILED_MARK in line.lower():
                return line.split(" [ERR] ", 1)[-1].strip()  # the message, without pid and time
        return None

    async def stop(self, timeout_s: float) -> None:
        await asyncio.to_thread(self.server.stop, timeout_s)


async def start_until_bus(stack: Stack) -> asyncio.Task[None]:
    """Start ``stack`` and return its running task once its bus answers (its services may still
    be starting: what waits on them says so); StackError with the reason when it stops first."""
    running = asyncio.create_task(stack.run())
    bus_ready = asyncio.ensure_future(stack.bus_ready.wait())
    await asyncio.wait([running, bus_ready], return_when=asyncio.FIRST_COMPLETED)
    bus_ready.cancel()
    if running.done():
        await running  # raises StackError with the reason
        raise StackError("the embedded stack stopped before it was ready")
    return running


def local_host(host: str) -> str:
    """Where this machine reaches a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def check_ports(settings: Settings, services: Collection[str] = ("gateway", "inference")) -> None:
    """Raise StackError naming the setting to change when a port the stack needs is taken
    (the gateway's and inference's only when ``services`` start them)."""
    problems = []
    if settings.nats_url is None:
        if settings.nats_port == settings.gateway_port:
            problems.append(f"nats_port and gateway_port are both {settings.nats_port}; change one "
                            "(--nats-port / FLYWHEEL_NATS_PORT or --gateway-port / FLYWHEEL_GATEWAY_PORT)")
        for port in settings.nats_ports:
            if port_open("127.0.0.1", port):
                node = "nats_port" if port == settings.nats_port else f"nats_port+{port - settings.nats_port}"
                problems.append(f"port {port} ({node}) is taken: choose a free one with --nats-port / "
                                "FLYWHEEL_NATS_PORT, or use the NATS server there with --nats-url / FLYWHEEL_NATS_URL")
    if "inference" in services and port_open(local_host(settings.inference_host), settings.inference_port):
        problems.append(f"port {settings.inference_port} (inference_port) is taken: choose a free one with "
                        "--inference-port / FLYWHEEL_INFERENCE_PORT")
    if "gateway" in services and port_open(local_host(settings.gateway_host), settings.gateway_port):
        problems.append(f"port {settings.gateway_port} (gateway_port) is taken: choose a free one with "
                        "--gateway-port / FLYWHEEL_GATEWAY_PORT")
    if "training_api" in services and port_open(local_host(settings.training_api_host), settings.training_api_port):
        problems.append(f"port {settings.training_api_port} (training_api_port) is taken: choose a free one with "
                        "FLYWHEEL_TRAINING_API_PORT")
    if problems:
        raise StackError("cannot start the stack:\n  " + "\n  ".join(problems))


class Stack:
    """Starts, supervises and stops the embedded stack. ``await run()`` until a signal.

    ``restart_backoff_s``, ``max_backoff_s`` and ``healthy_after_s`` set every process's
    :class:`RestartBackoff`; ``poll_interval_s`` is how often it looks at exits. Every
    ``health_every_s`` it runs each running process's health check (a service's fresh heartbeat,
    the gateway's ``/healthz``, nats-server's JetStream answering); one that fails it for
    ``unhealthy_after_s`` is stopped and started again like one that exited.
    """

    def __init__(
        self,
        settings: Settings,
        out: TextIO = sys.stdout,
        services: dict[str, ServiceSpec] | None = None,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 15.0,
        restart_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        healthy_after_s: float = 30.0,
        poll_interval_s: float = 0.25,
        health_every_s: float = 5.0,
        unhealthy_after_s: float = 60.0,
    ) -> None:
        self.data_dir = settings.data_dir.resolve()
        self.lock = DataFolderLock(self.data_dir)
        if settings.nats_url is None and settings.trainer.weights_dir is None:
            # Its own nats-server: every service is on this machine, and weights go through files.
            trainer = settings.trainer.model_copy(update={"weights_dir": self.data_dir / "weights"})
            settings = settings.model_copy(update={"trainer": trainer})
        self.settings = settings
        self.out = out
        self.log_dir = self.data_dir / "logs"
        # A nats-server of its own runs with a user a service (flywheel.contract.natsusers):
        # their passwords are made before the URLs, which carry them.
        self.nats_passwords = natsusers.load_or_create(self.data_dir) if settings.nats_url is None else None
        self.nats_url = settings.resolved_nats_url
        self.local_gateway_url = f"http://{local_host(settings.gateway_host)}:{settings.gateway_port}"
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.poll_interval_s = poll_interval_s
        self.health_every_s = health_every_s
        self.unhealthy_after_s = unhealthy_after_s
        self._beats: tuple[float, list[events.ServiceHeartbeat]] | None = None  # (when read, what)
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once everything started is healthy
        self.bus_ready = asyncio.Event()  # set once the bus answers (the services may still be starting)
        self.bus: Bus | None = None
        self.nats_nodes: list[NatsProcess] = []  # the nats-server it started, a process a node of its cluster
        env = child_env(settings)
        # Started first, so its imports overlap the rest of the start (flywheel.runtime.forkserver).
        self.fork_server = (forkserver.ForkServer(self.data_dir, env, self.log_dir / "fork-server.log")
                            if settings.fork_services else None)
        fork_from = self.data_dir if self.fork_server is not None else None
        self.services = [ServiceProcess(name, spec, env | self._nats_login(name) | metrics_port(settings, i),
                                        self.log_dir / f"{name}.log", fork_from)
                         for i, (name, spec) in enumerate((SERVICES if services is None else services).items())]
        for service in self.services:
            service.backoff = self._backoff()
        self.started: list[Process] = []  # in start order; stopped in reverse
        self.heartbeat: Service | None = None  # the stack's own, carrying view() as its info
        self.heartbeat_task: asyncio.Future[None] | None = None
        self._view_changed = asyncio.Event()
        # Awaited before the stack stops anything (with why it stops, None on a plain stop):
        # whoever works on the bus while the stack runs winds down first, the bus still there.
        self.before_shutdown: Callable[[BaseException | None], Awaitable[None]] | None = None

    def _nats_login(self, service: str) -> dict[str, str]:
        """The environment that logs ``service`` into the stack's own nats-server as its user (the
        orchestrator also gets the trainers' login; a process of another name, a login that
        server refuses); nothing for a server of nats_url."""
        if self.nats_passwords is None:
            return {}
        if service not in natsusers.SERVICE_USERS:  # a login the server refuses, never the operator's
            return login_env(service, "")
        env = login_env(service, self.nats_passwords[service])
        if service == "orchestrator":  # the login it gives its runs' trainers
            env["FLYWHEEL_NATS_TRAINER_PASSWORD"] = self.nats_passwords[natsusers.TRAINER]
        return env

    def _backoff(self) -> RestartBackoff:
        return RestartBackoff(Backoff(first_s=self.restart_backoff_s, max_s=self.max_backoff_s),
                              healthy_after_s=self.healthy_after_s)

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def view(self) -> dict[str, Any]:
        """The supervisor's view, as its heartbeat carries it to ``flywheel status``: every
        process it runs (the nats-server first when it started one), with the policy."""
        processes = [*self.nats_nodes, *self.services]
        return {"nats_url": natsusers.redacted(self.nats_url), "log_dir": str(self.log_dir),
                "restart_backoff_s": self.restart_backoff_s, "max_backoff_s": self.max_backoff_s,
                "healthy_after_s": self.healthy_after_s,
                "processes": [p.view() for p in processes]}

    def _changed(self) -> None:
        """A process changed state: renew the view the heartbeat carries, and beat soon."""
        if self.heartbeat is not None:
            self.heartbeat.info = self.view()
            self._view_changed.set()

    async def run(self) -> None:
        """Start everything, supervise until SIGINT/SIGTERM, then stop what was started.

        Raises StackError when start-up fails (after stopping what had started).
        """
        settings = self.settings
        self.lock.acquire({"pid": os.getpid(), "command": " ".join(["flywheel", *sys.argv[1:2]]),
                           "since": events.utc_now().isoformat(timespec="seconds"),
                           "ports": {"NATS": settings.nats_port, "gateway": settings.gateway_port,
                                     "inference": settings.inference_port}})
        try:
            check_ports(settings, {service.name for service in self.services})
            await self._run()
        finally:
            self.lock.release()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        failure: BaseException | None = None
        try:
            await self._start()
            if not self.stopping.is_set():
                await self._beat_now()  # whoever reads "Flywheel is up" then finds every process running
                self._say_ready()
                self.ready.set()
                await self._supervise()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if self.before_shutdown is not None:
                await self.before_shutdown(failure)
            await self._shutdown()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.fork_server is not None:
            self._start_fork_server(self.fork_server)
        if self.settings.nats_url is None:
            assert self.nats_passwords is not None
            config = natsusers.server_config(self.nats_passwords)
            if self.settings.nats_cluster == 1:
                if natsusers.adopt_store(self.data_dir / "nats"):
                    self.say(f"moved the streams of {self.data_dir / 'nats'} into NATS account {natsusers.ACCOUNT}")
                servers = [NatsServer(self.data_dir / "nats", port=self.settings.nats_port,
                                      log_file=self.log_dir / "nats-server.log", config=config)]
            else:
                servers = NatsCluster(self.data_dir / "nats-cluster", self.settings.nats_cluster,
                                      ports=self.settings.nats_ports, log_dir=self.log_dir, config=config).nodes
            for server in servers:
                node = NatsProcess(server)
                node.backoff = self._backoff()
                await node.launch()
                node.state = "running"
                node.healthy_at, node.healthy_since = time.monotonic(), events.utc_now()
                self.nats_nodes.append(node)
                self.started.append(node)
                self.lock.update({"nats_pids": [n.pid for n in self.nats_nodes]})
                self.say(f"started {node.name} (pid {node.pid}) on {natsusers.redacted(server.url)}, store "
                         f"{server.store_dir}, a user a service ({natsusers.USERS_FILE} in the data folder)")
        else:
            self.say(f"using the NATS server at {natsusers.redacted(self.nats_url)} (nats_url)")
        # Its own cluster keeps every stream on each node, and so does a cluster of nats_url given
        # nats_cluster; else a server of nats_url keeps what its streams have.
        replicas = self.settings.nats_cluster if self.nats_nodes or self.settings.nats_cluster > 1 else None
        if replicas and replicas > 1:
            self.say(f"waiting for the {replicas} NATS nodes to elect a JetStream leader, then every stream is kept "
                     f"on each node")
        self.bus = await Bus.connect(self.nats_url, name="flywheel-up", config=BusConfig(replicas=replicas))
        # Service.run closes the bus when it ends: _shutdown stops it after the services.
        self.heartbeat = Service(STACK_SERVICE, self.bus, info=self.view(), handle_signals=False)
        self.heartbeat.add_task(self._publish_changes)
        self.heartbeat_task = asyncio.ensure_future(self.heartbeat.run())
        self.bus_ready.set()
        # Every service at once: none needs another to start (they meet on the bus, and the
        # gateway's two processes migrate the store one after the other by themselves).
        self.started += self.services
        launches = {asyncio.ensure_future(self._launch_healthy(service)): service for service in self.services}
        try:
            pending = set(launches)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for launch in done:
                    service = launches[launch]
                    try:
                        launch.result()
                    except ProcessDied as exc:
                        raise StackError(f"{service.name} {exc} during start-up; {service.log_tail()}") from exc
                    except NotHealthy as exc:
                        raise StackError(f"{service.name} (pid {service.pid}) is {exc}; {service.log_tail()}") from exc
        finally:
            for launch in launches:
                launch.cancel()
            await asyncio.gather(*launches, return_exceptions=True)

    def _start_fork_server(self, server: forkserver.ForkServer) -> None:
        if not server.usable:
            self.say(f"no fork server (fork_services): this system or the socket path {server.folder} does not allow "
                     "one; each service imports its packages itself")
            self.fork_server = None
            for service in self.services:
                service.fork_from = None
            return
        server.start()
        assert server.process is not None
        self.say(f"started the fork server (pid {server.process.pid}): the services are forks of it, their packages "
                 f"imported once (fork_services); log {server.log_path}")

    async def _launch_healthy(self, process: Process) -> None:
        """Launch and wait until healthy (or until a stop is asked). Raises ProcessDied, or
        NotHealthy when it still runs but is not healthy after ``start_timeout_s``."""
        began = time.monotonic()
        await process.launch()
        if isinstance(process, NatsProcess):  # restarted: the folder's lock names its new pid
            self.lock.update({"nats_pids": [n.pid for n in self.nats_nodes]})
        if process not in self.started:
            self.started.append(process)
        process.state = "restarting" if process.num_restarts else "starting"
        process.next_start_at = None
        self._changed()
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
                process.state = "running"
                process.healthy_at, process.healthy_since = time.monotonic(), events.utc_now()
                self._changed()
                self.say(f"{process.name} is healthy ({time.monotonic() - began:.1f}s)")
                return
            if time.monotonic() - began > self.start_timeout_s:
                raise NotHealthy(self.start_timeout_s, problem)
            if await wait_set(self.stopping, self.poll_interval_s):
                return

    def _say_ready(self) -> None:
        gateway = self.settings.resolved_gateway_url
        pids = ", ".join(str(node.pid) for node in self.nats_nodes)
        nats_owner = ("pid " if len(self.nats_nodes) == 1 else "pids ") + pids if self.nats_nodes else "existing server"
        # A stack of some services (flywheel eval's) has no gateway to name.
        with_gateway = any(service.name == "gateway" for service in self.services)
        inference = f"http://{local_host(self.settings.inference_host)}:{self.settings.inference_port}"
        training = f"http://{local_host(self.settings.training_api_host)}:{self.settings.training_api_port}"
        self.say("\n".join([
            "Flywheel is up. Ctrl-C stops it.",
            *([f"  gateway   {gateway}", f"  API docs  {gateway}/docs"] if with_gateway else []),
            "  API keys  " + ("none: the API runs open, for callers on this machine only (auth = open; "
                              "FLYWHEEL_AUTH=keys wants keys)" if self.settings.auth == "open"
                              else "required (auth = keys): `flywheel keys create --tenant T` makes one"),
            *([] if with_gateway else [f"  inference {inference}/v1"]),
            *([f"  training  {training} (the Tinker SDK's base_url; api_key tml-..., docs/training-api.md)"]
              if any(service.name == "training_api" for service in self.services) else []),
            f"  NATS      {natsusers.redacted(self.nats_url)} ({nats_owner})",
            f"  data      {self.data_dir}",
            f"  logs      {self.log_dir}",
        ]))

    async def _supervise(self) -> None:
        """One watcher per process, so a process backing off never delays noticing another's
        exit; until a stop is asked. A watcher's or the heartbeat's own failure (a bug) ends it."""
        assert self.heartbeat_task is not None
        watchers = [asyncio.ensure_future(self._keep_running(p)) for p in self.started]
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        waited: list[asyncio.Future[Any]] = [*watchers, self.heartbeat_task, stop_wait]
        try:
            done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises a watcher's or the heartbeat's error
        finally:
            stop_wait.cancel()
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _keep_running(self, process: Process) -> None:
        """Start ``process`` again whenever it exits, after its backoff, until a stop is asked.
        Never gives up: while it backs off, the rest of the stack keeps serving."""
        while True:
            ended = await self._exit_of(process)
            if ended is None:
                return
            if isinstance(ended, str):  # it runs, but its health check failed all along: stopped
                how_long = "" if process.cure == "restart" else f" for {self.unhealthy_after_s:g}s while it ran"
                last_exit, what = "not healthy", f"was stopped: {ended}{how_long}"
            else:
                last_exit, what = exit_text(ended), f"exited unexpectedly with {exit_text(ended)}"
            while True:
                delay_s = self._back_off(process, last_exit, what)
                if await wait_set(self.stopping, delay_s):
                    return
                process.num_restarts += 1
                try:
                    await self._launch_healthy(process)
                    break
                except ProcessDied as exc:
                    last_exit, what = exit_text(exc.returncode), f"{exc} before it was healthy"
                except NotHealthy as exc:
                    await process.stop(self.stop_timeout_s)
                    last_exit, what = "not healthy", f"was stopped, {exc}"
                except StackError as exc:  # the nats-server could not start again (its port taken?)
                    last_exit, what = "did not start", str(exc)

    async def _exit_of(self, process: Process) -> int | str | None:
        """Wait until ``process`` exits (its exit status) or has failed its health check every
        ``health_every_s`` for ``unhealthy_after_s`` while it ran (why, once it is stopped: a loop
        that blocks, a store that failed, keep a process alive and useless); None once a stop is asked."""
        next_check = time.monotonic() + self.health_every_s
        unhealthy_since: float | None = None
        while not self.stopping.is_set():
            returncode = process.returncode()
            if returncode is not None:
                return returncode
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.health_every_s
                problem = await self._health_now(process)
                self._waiting(process, problem if process.cure == "wait" else None)
                if problem is None or process.cure == "wait":  # waiting is not unhealthy time: no restart cures it
                    unhealthy_since = None
                    continue
                unhealthy_since = unhealthy_since or now
                if process.cure == "restart" or now - unhealthy_since >= self.unhealthy_after_s:
                    self.say(f"{process.name} (pid {process.last_pid}) is not healthy: {problem}; stopping it")
                    await process.stop(self.stop_timeout_s)
                    return problem
            await wait_set(self.stopping, self.poll_interval_s)
        return None

    def _waiting(self, process: Process, problem: str | None) -> None:
        """Say once that ``process`` waits for something a restart does not cure (a full disk),
        and once that it waits no more; its state shows it meanwhile."""
        if problem == process.problem:
            return
        if problem is not None and process.problem is None:
            self.say(f"{process.name} (pid {process.last_pid}) waits: {problem}")
        elif problem is None:
            self.say(f"{process.name} (pid {process.last_pid}) waits no more: {process.problem.split(';')[0]} "
                     "is over" if process.problem else f"{process.name} waits no more")
        process.problem = problem
        process.state = "waiting" if problem is not None else "running"
        self._changed()

    async def heartbeats(self) -> list[events.ServiceHeartbeat]:
        """The services' heartbeats, read at most once a poll interval (every process's check reads them)."""
        assert self.bus is not None
        now = time.monotonic()
        if self._beats is None or now - self._beats[0] > self.poll_interval_s:
            self._beats = (now, await read_heartbeats(self.bus))
        return self._beats[1]

    async def _health_now(self, process: Process) -> str | None:
        """``process``'s health check now; None when healthy, or when the check cannot tell (the bus
        away: its own restart is what the stack watches then)."""
        if self.bus is None or not self.bus.nc.is_connected:
            return None
        try:
            return await asyncio.wait_for(process.health(self), HEALTH_CHECK_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error, OSError):
            return None

    def _back_off(self, process: Process, last_exit: str, what: str) -> float:
        """Record an exit, say it with the tail of the log and the next try; the wait before it."""
        now = time.monotonic()
        healthy_for_s = 0.0 if process.healthy_at is None else now - process.healthy_at
        delay_s = process.backoff.after_exit(healthy_for_s)
        process.state = "backing off"
        process.last_exit, process.last_exit_at = last_exit, events.utc_now()
        process.next_start_at = process.last_exit_at + timedelta(seconds=delay_s)
        process.healthy_at = process.healthy_since = None
        self._changed()
        after = f" after {healthy_for_s:.1f}s healthy" if healthy_for_s else ""
        if process.backoff.num_failures == 1:
            plan = f"restarting in {delay_s:g}s (restart {process.num_restarts + 1})"
        else:
            at = (datetime.now().astimezone() + timedelta(seconds=delay_s)).strftime("%H:%M:%S")
            plan = (f"restarting in {delay_s:g}s, at {at} (restart {process.num_restarts + 1}; exit "
                    f"{process.backoff.num_failures} in a row, each before {self.healthy_after_s:g}s healthy: "
                    f"the wait doubles, up to {self.max_backoff_s:g}s)")
        self.say(f"{process.name} (pid {process.last_pid}) {what}{after}; {plan}; {process.log_tail()}")
        return delay_s

    async def _beat_now(self) -> None:
        """Publish the current view at once (a bus that is away: the next beat carries it)."""
        if self.heartbeat is None:
            return
        self.heartbeat.info = self.view()
        try:
            await self.heartbeat.beat()
        except nats.errors.Error:
            pass  # the bus is away this moment: the Service's next beat carries the view (it logs the failure)

    async def _publish_changes(self, stopping: asyncio.Event) -> None:
        """A task of the stack's heartbeat: beat as soon as the view changed, so ``flywheel
        status`` shows a restart or a backoff when it happens (the Service also beats every
        few seconds, with the latest view)."""
        assert self.heartbeat is not None
        while not stopping.is_set():
            if not await wait_set(self._view_changed, self.poll_interval_s):
                continue
            self._view_changed.clear()
            try:
                await self.heartbeat.beat()
            except nats.errors.Error:
                pass  # NATS is restarting: the Service's next beat carries the view (it logs the failure)

    async def _shutdown(self) -> None:
        services = [p for p in self.started if p not in self.nats_nodes]
        if self.started:
            self.say("stopping: " + ", ".join(p.name for p in reversed(self.started)))
        try:
            for process in reversed(services):
                await process.stop(self.stop_timeout_s)
                process.state = "stopped"
                self._changed()
                self.say(f"stopped {process.name}")
            await self._stop_heartbeat()
            if self.bus is not None:
                await self._close_bus(self.bus)  # Service.run closed it already unless it failed
        finally:  # the servers go last, and whatever happened above
            if self.fork_server is not None:
                await asyncio.to_thread(self.fork_server.stop)
            for node in self.nats_nodes:
                await node.stop(self.stop_timeout_s)
                node.state = "stopped"
                self.say(f"stopped {node.name}")

    async def _stop_heartbeat(self) -> None:
        """Remove the stack's heartbeat (and close the bus: Service.run does both)."""
        if self.heartbeat is None or self.heartbeat_task is None or self.heartbeat_task.done():
            return
        self.heartbeat.stop()
        try:
            await asyncio.wait_for(self.heartbeat_task, self.stop_timeout_s)
        except TimeoutError:
            self.say(f"the stack's heartbeat did not stop within {self.stop_timeout_s:g}s")

    async def _close_bus(self, bus: Bus) -> None:
        try:
            await asyncio.wait_for(bus.close(), self.stop_timeout_s)
        except (TimeoutError, nats.errors.Error) as exc:
            # NATS is gone or going: the connection has nothing left to flush.
            self.say(f"closing the NATS connection: {type(exc).__name__}: {exc}")
            await bus.nc.close()


def run(settings: Settings, out: TextIO = sys.stdout, training_api: bool = False) -> None:
    """Run the embedded stack in the foreground until SIGINT or SIGTERM (with the training API
    when ``training_api``)."""
    services = {**SERVICES, "training_api": TRAINING_API} if training_api else None
    asyncio.run(Stack(settings, out, services=services).run())
