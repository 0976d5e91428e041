"""Start the embedded stack's Python services as forks of a process that imported them once.

Why: on one machine every service imports the same packages before it does anything:
flywheel's own, nats, pydantic and FastAPI in each of them (about half a CPU-second each),
torch and transformers in inference and in a run's trainer (about five CPU-seconds each). On a
machine of two cores those imports are most of the time from ``flywheel run`` to the first
training step. A fork server imports them once; each service is a fork of it that runs its
module as ``python -m`` would, with its own arguments, environment, session and log, and
shares the imported pages with the others.

How:

- :class:`ForkServer` (in ``flywheel up``) binds two Unix sockets in ``<data_dir>/fork``
  (a folder only this user may enter): ``base.sock`` for services that need no torch,
  ``torch.sock`` for those that do. It then starts ``python -m flywheel.runtime.forkserver``
  with both, before the nats-server, so the imports overlap the rest of the start.
- The server forks at once: one process serves ``base.sock``, having imported the base
  modules, the other ``torch.sock``, having imported torch, transformers and the modules of
  the services that use them. Each imports when it is first asked for a service (a request
  waits in the socket's queue meanwhile), so the two imports run side by side, and a stack
  of services that need no torch never imports it.
- :func:`launch` (the stack's services; the orchestrator's trainer) connects, sends the
  argv (``-m MODULE ARGS``), environment, folder and log file, and gets the child's pid. The
  connection stays open: the server writes the child's exit status there when it ends, and
  when the connection closes first (whoever asked died) the server sends the child's
  session SIGTERM, as the kernel does to an exec'd child of a dead parent
  (:func:`flywheel.runtime.natsserver.die_with_parent`). A child gets SIGTERM when its server
  dies, and the server when the stack dies.
- The child: its own session, stdin from /dev/null, stdout and stderr to the log, the
  request's environment and folder, its argv as its process title (``ps`` shows
  ``python -m flywheel_inference``), then ``runpy`` runs the module as ``__main__``; its exit
  runs the ``atexit`` functions as an interpreter's would.

When the server cannot serve a request (no server: a deployment, a stack of an older
version, a data folder whose socket path is too long; another interpreter or PYTHONPATH
than the server's), :func:`launch` starts the command as its own interpreter, as before.
The setting ``fork_services = false`` always does, and a machine with a GPU
(:data:`ACCELERATOR_DEVICES`) has no torch level.

Not covered: modules a service imports later than its start, by what it is asked (a run's
environment, another model's code), are imported by that service itself.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import gc
import importlib
import json
import logging
import os
import runpy
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flywheel.runtime.natsserver import die_with_parent

log = logging.getLogger(__name__)

# What every Python service imports at start (the light level, base.sock).
BASE_MODULES = (
    "flywheel.contract.bus", "flywheel.contract.service", "flywheel.contract.settings", "flywheel.contract.config",
    "flywheel.contract.runs", "flywheel.sdk.environment", "flywheel.sdk.scoring", "httpx", "fastapi", "uvicorn",
    "flywheel_gateway.app", "flywheel_gateway.recorder", "flywheel_orchestrator.owner", "flywheel_scorer.scorer",
    "flywheel_sandbox.service",
)
# What inference and a run's trainer import on top (the torch level, torch.sock): the model
# classes of the models flywheel builds, so loading one imports nothing more.
TORCH_MODULES = (
    "torch", "transformers", "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2",
    "flywheel.sdk.models", "flywheel_inference.worker", "flywheel_inference.app", "flywheel_trainer.service",
)
LEVELS = ("base", "torch")
# Where one is, the torch level is left out: a GPU runtime that a parent touched (transformers
# asks torch whether CUDA is there) does not work in its forks, so inference and the trainer
# start their own interpreters on such a machine.
ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/kfd")
MAX_SOCKET_PATH = 100  # bytes; Linux's limit is 108 with the terminating NUL


def socket_dir(data_dir: Path) -> Path:
    return data_dir.resolve() / "fork"


def socket_path(data_dir: Path, level: str) -> Path:
    return socket_dir(data_dir) / f"{level}.sock"


class Child(Protocol):
    """What the supervisors need of a child process: a Popen, or a :class:`Forked`."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Forked:
    """A child of the fork server: its pid, and its exit status once the server says it."""

    pid: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    returncode: int | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _watch: asyncio.Future[None] | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exited (from a thread: the event loop reads the status)."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    async def _watch_exit(self) -> None:
        line = b""
        with contextlib.suppress(OSError):
            line = await self.reader.readline()
        try:
            self.returncode = int(json.loads(line)["returncode"])
        except (ValueError, KeyError, TypeError):
            # The server is gone (killed): the child got SIGTERM from the kernel; its status is
            # the server's to read, not ours. Wait until it has gone too, so that nothing
            # restarts it while it still holds its ports.
            await _wait_gone(self.pid)
            self.returncode = -signal.SIGTERM
        finally:
            self.writer.close()
            self._done.set()


async def _wait_gone(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    gone = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(fd, gone.set)
    try:
        await gone.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def launch(argv: list[str], env: dict[str, str], log_path: Path, fork: tuple[Path, str] | None) -> Child:
    """Start ``python ARGV`` (``argv`` after the interpreter) with ``env``, its output appended
    to ``log_path``, in a new session, dying with this process: forked by the fork server of
    ``fork`` (data folder, level) when there is one that takes it, else exec'd."""
    if fork is not None and argv[:1] == ["-m"]:  # a module: what a fork can run
        forked = await _ask(argv, env, log_path, *fork)
        if forked is not None:
            return forked
    with log_path.open("ab") as log_file:
        # Popen returns once the child has exec'd (milliseconds).
        return subprocess.Popen(  # noqa: ASYNC220 - a fork and exec, see above
            [sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509 - PR_SET_PDEATHSIG: set in the child only


async def _ask(argv: list[str], env: dict[str, str], log_path: Path, data_dir: Path, level: str) -> Forked | None:
    path = socket_path(data_dir, level)
    if not path.exists():  # no server made it (a deployment; a path too long for a socket)
        return None
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError:  # a socket left by a stack that was killed: nothing listens
        return None
    request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path.resolve()),
               "executable": sys.executable}
    try:
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        answer = json.loads(await reader.readline() or b"{}")
    except (OSError, ValueError):
        answer = {}
    if "pid" not in answer:
        if answer.get("refused"):
            log.info("fork server (%s): %s; starting its own interpreter", level, answer["refused"])
        writer.close()
        return None
    forked = Forked(int(answer["pid"]), reader, writer)
    forked._watch = asyncio.ensure_future(forked._watch_exit())
    return forked


class ForkServer:
    """The stack's side: the sockets, and the server process it starts on them."""

    def __init__(self, data_dir: Path, env: dict[str, str], log_path: Path,
                 modules: tuple[tuple[str, ...], tuple[str, ...]] = (BASE_MODULES, TORCH_MODULES)) -> None:
        self.data_dir = data_dir
        self.folder = socket_dir(data_dir)
        self.env = env
        self.log_path = log_path
        self.modules = modules  # what each level imports
        self.process: subprocess.Popen[bytes] | None = None
        self.levels = LEVELS if not any(os.path.exists(d) for d in ACCELERATOR_DEVICES) else LEVELS[:1]

    @property
    def usable(self) -> bool:
        """Whether this machine and data folder allow one: Linux (pidfds, peer credentials) and a
        socket path within the limit."""
        return (hasattr(os, "pidfd_open") and hasattr(socket, "SO_PEERCRED")
                and len(str(socket_path(self.data_dir, "torch")).encode()) <= MAX_SOCKET_PATH)

    def start(self) -> None:
        """Bind the sockets and start the server on them (it dies with this process)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        sockets: dict[str, socket.socket] = {}
        for level in LEVELS:
            path = socket_path(self.data_dir, level)
            path.unlink(missing_ok=True)
            if level in self.levels:
                sockets[level] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sockets[level].bind(str(path))
                sockets[level].listen(64)
        fds = {level: sock.fileno() for level, sock in sockets.items()}
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flywheel.runtime.forkserver", str(fds["base"]), str(fds.get("torch", -1)),
                 *(",".join(modules) for modules in self.modules)], stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, env=self.env, pass_fds=list(fds.values()),
                start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509 - PR_SET_PDEATHSIG: in the child
        for sock in sockets.values():  # the server has them; a connection made now waits for it
            sock.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for level in LEVELS:
            socket_path(self.data_dir, level).unlink(missing_ok=True)


# --- the server ----------------------------------------------------------------------------------

def _title(text: str) -> None:
    with contextlib.suppress(ImportError):
        # imported here: optional (the embedded extra); without it, ps shows the server's command
        import setproctitle

        setproctitle.setproctitle(text)


def _preload(modules: tuple[str, ...]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an extra not installed: the service imports (or misses) it itself
            print(f"fork server: not preloaded: {name} ({type(exc).__name__}: {exc})", flush=True)


@dataclass
class _Running:
    pid: int
    pidfd: int
    conn: socket.socket | None


class _Server:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, ("accept", None))
        self.children: dict[int, _Running] = {}

    def serve(self) -> None:
        gc.freeze()  # the preloaded heap: its pages stay shared, and no child's collections walk it
        while True:
            for key, _ in self.selector.select():
                kind, child = key.data
                if kind == "accept":
                    self._accept()
                elif kind == "exited":
                    self._reap(child)
                else:
                    self._asker_gone(child)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():  # the folder keeps others out; this too
            conn.close()
            return
        conn.settimeout(10.0)  # the request follows the connection at once
        try:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    raise ValueError("the connection closed before a whole request")
                data += chunk
            request = json.loads(data)
        except (OSError, ValueError):
            conn.close()
            return
        conn.settimeout(None)
        refused = self._refusal(request)
        if refused:
            self._send(conn, {"refused": refused})
            conn.close()
            return
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _become(request, self._fds(conn), server)
        pidfd = os.pidfd_open(pid)
        child = self.children[pid] = _Running(pid, pidfd, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, ("exited", child))
        self._send(conn, {"pid": pid})
        self.selector.register(conn, selectors.EVENT_READ, ("conn", child))

    def _refusal(self, request: dict[str, Any]) -> str | None:
        argv = request.get("argv")
        if not isinstance(argv, list) or len(argv) < 2 or argv[0] != "-m":
            return f"argv {argv!r} is not -m MODULE ARGS"
        if request.get("executable") != sys.executable:
            return f"it runs {request.get('executable')}, this server {sys.executable}"
        if request.get("env", {}).get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
            return "its PYTHONPATH differs from this server's"
        return None

    def _fds(self, conn: socket.socket) -> list[int]:
        return [self.listener.fileno(), self.selector.fileno(), conn.fileno(),
                *(c.conn.fileno() for c in self.children.values() if c.conn is not None),
                *(c.pidfd for c in self.children.values())]

    @staticmethod
    def _send(conn: socket.socket, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(message).encode() + b"\n")

    def _reap(self, child: _Running) -> None:
        _, status = os.waitpid(child.pid, 0)
        self.selector.unregister(child.pidfd)
        os.close(child.pidfd)
        del self.children[child.pid]
        if child.conn is not None:
            self._send(child.conn, {"returncode": os.waitstatus_to_exitcode(status)})
            self.selector.unregister(child.conn)
            child.conn.close()

    def _asker_gone(self, child: _Running) -> None:
        assert child.conn is not None
        with contextlib.suppress(OSError):
            if child.conn.recv(1):
                return  # nothing is sent after the request; ignored
        self.selector.unregister(child.conn)
        child.conn.close()
        child.conn = None
        # Its group (it and what it started) once it made one; the child itself as well, which may
        # not have called setsid yet when its asker died right after the fork.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child.pid, signal.SIGTERM)


def _become(request: dict[str, Any], inherited: list[int], server: int) -> None:
    """In the forked child of ``server`` (its pid): become ``python ARGV`` of the request; never returns."""
    code = 1
    try:
        for fd in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.setsid()
        die_with_parent()
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if os.getppid() != server:  # it died between the fork and the line above: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)
        out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        _title(" ".join([sys.executable, *argv]))
        sys.argv = [argv[1], *argv[2:]]
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flywheel.runtime.forkserver",
                                     description="The embedded stack's fork server (started by `flywheel up`).")
    parser.add_argument("base_fd", type=int, help="the listening socket of the base level")
    parser.add_argument("torch_fd", type=int, help="the listening socket of the torch level (-1: none)")
    parser.add_argument("base_modules", help="what the base level imports, comma-separated")
    parser.add_argument("torch_modules", help="what the torch level imports on top, comma-separated")
    args = parser.parse_args(argv)
    base = socket.socket(fileno=args.base_fd)
    # Two servers from the start, each importing its level once it is first asked for a service
    # (a stack of services that need no torch never imports it), so torch's import, the longest
    # on the way to the first step, runs beside the base level's, on another core.
    if args.torch_fd >= 0:
        torch_level = socket.socket(fileno=args.torch_fd)
        if os.fork() == 0:
            try:
                base.close()
                die_with_parent()
                _serve(torch_level, "torch", args.torch_modules)
            finally:  # it serves until killed; a failure ends this process, never runs the base level
                traceback.print_exc()
                os._exit(1)
        torch_level.close()
    _serve(base, "base", args.base_modules)


def _serve(listener: socket.socket, level: str, modules: str) -> None:
    _title(f"flywheel fork server ({level})")
    select.select([listener], [], [])  # the first request waits in the queue meanwhile
    _preload(tuple(filter(None, modules.split(","))))
    print(f"fork server: {level} level ready (pid {os.getpid()})", flush=True)
    _Server(listener).serve()


if __name__ == "__main__":
    main()
