"""Where sandboxes run: the agent channel every backend shares, and the local backend.

A backend starts a :class:`Box`: one isolated process tree whose first process is the
agent (``agent.py``), reached over a pipe. The session manager talks to boxes only through
:meth:`Box.call` and :meth:`Box.stop`, so backends differ only in how they start and kill.

The local backend (bubblewrap), per sandbox:

- its own user, PID, network (only ``lo``: no network at all; ``--share-net`` only for a
  spec with ``network=True``, which the service refuses unless setting
  ``sandbox_allow_network`` is on), IPC, UTS and cgroup namespaces; a user namespace made
  by an unprivileged user id of its own (``uid_base`` + slot, never root), so RLIMIT_NPROC
  counts only its processes and nothing in it holds a capability on the host; nested user
  namespaces are refused where bubblewrap can;
- a filesystem of read-only binds of the host's ``/usr`` (and its ``/bin``, ``/lib``
  links) and ``/etc/ld.so.cache``, a fresh ``/proc`` and minimal ``/dev``, and three tmpfs
  mounts of ``disk_mb`` each, the only places it can write: ``/work`` (the workdir),
  ``/tmp`` and ``/dev/shm`` (POSIX shared memory). The root bubblewrap builds (a tmpfs the
  sandbox's user owns, holding ``/etc`` and the mount points) and ``/dev`` are remounted
  read-only once the mounts are made, so ``/x``, ``/etc/x`` or a new ``/home`` fail with
  EROFS; nothing else of the host is visible;
- cgroup v1 memory, pids and cpu limits where this process may create cgroups (it checks at
  start and logs what it found), else rlimits only (address space per process);
- rlimits on every command: processes, file size, open files, CPU seconds, no core dumps;
- the whole tree dies with SIGKILL to bubblewrap (its PID namespace goes with it), and
  cgroup members are killed as well.

Run by a user other than root, sandboxes share that user's id and get no cgroups: no
process limit then, and memory is held per process (address space) only.

Not isolated by the local backend: the kernel itself (no seccomp filter: a kernel bug is a
way out), the contents of the host's ``/usr`` (readable), CPU time when no cpu cgroup can be
made, and, where the service allows network, a spec with ``network=True`` (it then shares the
host's network namespace, loopback services included).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flywheel.sdk.sandbox import WORKDIR, SandboxError, SandboxSpec
from flywheel_sandbox.relay import SOCKET_DIR, ModelRelay, open_relay

log = logging.getLogger(__name__)

AGENT_PATH = Path(__file__).parent / "agent.py"
# The agent's source arrives on its stdin ("<length>\n<source>"), then the frames follow.
AGENT_BOOTSTRAP = "import sys; b = sys.stdin.buffer; exec(compile(b.read(int(b.readline())), 'agent.py', 'exec'))"
MiB = 1024 * 1024
# Processes (and threads) of the sandbox beyond the spec's: bubblewrap's init, the agent, its
# model forwarder thread (a spec with a model_url), bash.
EXTRA_PIDS = 5
# Memory the agent and bubblewrap need on top of what the spec gives the commands.
AGENT_MEMORY_BYTES = 48 * MiB
# The only places a sandbox can write, each a tmpfs of spec.disk_mb (both backends); /dev/shm
# is there for POSIX shared memory and semaphores (Python's multiprocessing needs it).
WRITABLE = (WORKDIR, "/tmp", "/dev/shm")
PYTHON_PATH_DIR = "/opt/python"  # where setting sandbox_python_path's folders are bound


class BackendUnavailable(Exception):
    """The backend cannot run here (a program or engine is missing); the message says what to install."""


class AgentGone(Exception):
    """The agent stopped answering (killed, crashed or the box was destroyed)."""


class AgentChannel:
    """Length-prefixed JSON frames to and from the agent; one call at a time."""

    def __init__(self, read_exactly: Callable[[int], Awaitable[bytes]],
                 write: Callable[[bytes], Awaitable[None]]) -> None:
        self._read_exactly = read_exactly
        self._write = write
        self._lock = asyncio.Lock()

    async def read_frame(self) -> dict[str, Any]:
        try:
            header = await self._read_exactly(4)
            body = await self._read_exactly(struct.unpack(">I", header)[0])
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise AgentGone(f"the sandbox's agent is gone ({type(exc).__name__})") from exc
        return json.loads(body)

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(request).encode()
        async with self._lock:
            try:
                await self._write(struct.pack(">I", len(body)) + body)
            except (ConnectionError, OSError) as exc:
                raise AgentGone(f"the sandbox's agent is gone ({type(exc).__name__})") from exc
            return await self.read_frame()


class Box(Protocol):
    """A started sandbox."""

    channel: AgentChannel

    @property
    def alive(self) -> bool: ...

    async def stop(self) -> None:
        """Kill everything in the sandbox and release what it held; idempotent."""


class Backend(Protocol):
    name: str

    async def start(self, spec: SandboxSpec) -> Box:
        """Start a sandbox for ``spec`` and wait for its agent's ready frame."""

    def limits(self, spec: SandboxSpec) -> dict[str, int]:
        """The sandbox's rlimits (see agent.RLIMITS): the agent sets them on itself, every command inherits them."""

    def pool_key(self, spec: SandboxSpec) -> tuple[Any, ...]:
        """Specs with equal keys can share a warm-pool box (env, files, labels are applied later)."""

    async def close(self) -> None:
        """Release what the backend holds (cgroup folders); boxes are stopped before."""


def pool_key(spec: SandboxSpec) -> tuple[Any, ...]:
    return (spec.image, spec.cpu, spec.memory_mb, spec.pids, spec.disk_mb, spec.network, spec.model_url)


def agent_argv(python: str) -> list[str]:
    """Starts the agent; then send :func:`agent_preamble` on its stdin."""
    return [python, "-I", "-S", "-c", AGENT_BOOTSTRAP]


def agent_preamble() -> bytes:
    source = AGENT_PATH.read_bytes()
    return b"%d\n" % len(source) + source


def start_failed(stderr_tail: bytearray, exc: BaseException) -> SandboxError:
    """The error for a sandbox whose agent never said it was ready: the sandbox's last words."""
    said = bytes(stderr_tail).decode(errors="replace")[-1000:]
    return SandboxError("failed", f"the sandbox did not start: {said or repr(exc)}")


def decode_b64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def encode_b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class Child:
    """A process started off the event loop, with asyncio pipes and an exit future.

    ``subprocess.Popen`` blocks until the child has exec'd; joining cgroup v1 groups in the
    child takes milliseconds (the kernel waits for an RCU grace period), so the start runs
    in a thread and the loop keeps answering other sandboxes meanwhile.
    """

    def __init__(self, popen: subprocess.Popen[bytes], stdout: asyncio.StreamReader, stdin: asyncio.StreamWriter,
                 stderr: asyncio.StreamReader) -> None:
        self.popen = popen
        self.stdout, self.stdin, self.stderr = stdout, stdin, stderr
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(cls, argv: list[str], preexec_fn: Callable[[], None]) -> Child:
        loop = asyncio.get_running_loop()

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=preexec_fn)  # noqa: PLW1509  # on purpose: the child joins its cgroups, takes its uid

        spawning = loop.run_in_executor(None, spawn)
        try:
            popen = await asyncio.shield(spawning)
        except asyncio.CancelledError:  # the spawn goes on in its thread: what it starts is killed
            def kill_when_spawned(done: asyncio.Future[subprocess.Popen[bytes]]) -> None:
                if not done.cancelled() and done.exception() is None:
                    _kill_and_reap(done.result())

            spawning.add_done_callback(kill_when_spawned)
            raise
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        try:
            readers = []
            for pipe in (popen.stdout, popen.stderr):
                reader = asyncio.StreamReader(limit=2**24)
                await loop.connect_read_pipe(functools.partial(asyncio.StreamReaderProtocol, reader), pipe)
                readers.append(reader)
            transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
        except BaseException:  # cancelled (the service stopping) before the box exists: nothing left running
            _kill_and_reap(popen)
            raise
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        return cls(popen, readers[0], writer, readers[1])

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        if not self.exited.done():
            self.exited.set_result(self.popen.wait())

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    def kill(self) -> None:
        if self._pidfd >= 0:  # not reaped yet, so the pid is still this process
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        return await self.exited


def _kill_and_reap(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILL a sandbox's bubblewrap that no box holds, and reap it in a thread."""
    with contextlib.suppress(ProcessLookupError):
        popen.kill()
    threading.Thread(target=popen.wait, name="flywheel-reap", daemon=True).start()


# --- cgroups (v1) -------------------------------------------------------------------------


@dataclass
class Cgroups:
    """Per-sandbox cgroup v1 folders under this process's own cgroup, one per controller found."""

    roots: dict[str, Path]  # controller -> our folder ("flywheel-sandbox-<pid>")

    @classmethod
    def detect(cls, controllers: tuple[str, ...] = ("memory", "pids", "cpu")) -> Cgroups:
        own: dict[str, str] = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(","):
                own[name] = path
        roots: dict[str, Path] = {}
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if not rfields or rfields[0] != "cgroup":
                continue
            options = set(rfields[-1].split(","))
            for controller in controllers:
                if controller in options and controller in own and controller not in roots:
                    mount_root, mount_point = fields[3], fields[4]
                    rel = os.path.relpath(own[controller], mount_root)
                    parent = Path(mount_point) / (rel if rel != "." else "")
                    folder = parent / f"flywheel-sandbox-{os.getpid()}"
                    try:
                        folder.mkdir(exist_ok=True)
                    except OSError:
                        continue
                    roots[controller] = folder
                    _remove_stale(parent)
        return cls(roots)

    def make(self, name: str, spec: SandboxSpec) -> list[Path]:
        """The sandbox's folders with its limits written; the ``cgroup.procs`` files to join."""
        values = {
            "memory": {"memory.limit_in_bytes": spec.memory_mb * MiB + AGENT_MEMORY_BYTES},
            "pids": {"pids.max": spec.pids + EXTRA_PIDS},
            "cpu": {"cpu.cfs_period_us": 100_000, "cpu.cfs_quota_us": int(spec.cpu * 100_000)},
        }
        procs = []
        for controller, root in self.roots.items():
            folder = root / name
            folder.mkdir(exist_ok=True)
            for key, value in values[controller].items():
                (folder / key).write_text(str(value))
            procs.append(folder / "cgroup.procs")
        return procs

    def kill_and_remove(self, name: str) -> bool:
        """SIGKILL every member, then remove the folders; False while members remain."""
        done = True
        for root in self.roots.values():
            folder = root / name
            if not folder.exists():
                continue
            for pid in (folder / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                folder.rmdir()
            except OSError:  # members not reaped yet
                done = False
        return done

    def close(self) -> None:
        for root in self.roots.values():
            try:
                root.rmdir()
            except OSError as exc:
                log.warning("cannot remove %s: %s", root, exc)


def _remove_stale(parent: Path) -> None:
    """Folders of services that died without cleaning up (SIGKILL): empty once their
    sandboxes died with them, so removable."""
    for folder in parent.glob("flywheel-sandbox-*"):
        pid = folder.name.rsplit("-", 1)[1]
        if not pid.isdigit() or Path("/proc", pid).exists():
            continue
        try:
            for leaf in folder.iterdir():
                if leaf.is_dir():
                    leaf.rmdir()
            folder.rmdir()
        except OSError:  # a member still alive: leave it
            pass


# --- local backend --------------------------------------------------------------------------


@dataclass
class LocalConfig:
    bwrap: str = "bwrap"
    python: str = "/usr/bin/python3"
    uid_base: int = 200_000  # sandbox slot i runs as uid/gid uid_base + i (no passwd entry needed)
    num_uids: int = 4096
    start_timeout_s: float = 10.0
    use_cgroups: bool = True
    python_path: tuple[str, ...] = ()  # host folders bound read-only at /opt/python/<i>, on PYTHONPATH
    relay_dir: str | None = None  # setting sandbox_relay_dir: where model relays make their sockets


@dataclass
class LocalBox:
    process: Child
    channel: AgentChannel
    uid: int
    cgroup: str
    backend: LocalBackend
    relay: ModelRelay | None = None
    stderr_tail: bytearray = field(default_factory=bytearray)
    stopped: bool = False

    @property
    def alive(self) -> bool:
        return not self.stopped and self.process.returncode is None

    async def stop(self) -> None:
        """SIGKILL to bubblewrap now (its init dies with it, and with init the whole PID
        namespace); waiting for the exit, the cgroup cleanup and the uid release go on in
        the background (:meth:`LocalBackend.close` waits for them)."""
        if self.stopped:
            return
        self.stopped = True
        if self.process.returncode is None:
            self.process.kill()
        self.backend.track(self._clean_up())

    async def _clean_up(self) -> None:
        await self.process.wait()
        if self.relay is not None:
            await self.relay.close()
        for _ in range(400):
            if self.backend.cgroups.kill_and_remove(self.cgroup):
                break
            await asyncio.sleep(0.005)  # polling interval while the kernel reaps the members
        else:
            log.warning("cgroup %s still has members after kill", self.cgroup)
        self.backend.release_uid(self.uid)


class LocalBackend:
    """Bubblewrap sandboxes run by unprivileged user ids of their own (see the module docstring)."""

    name = "local"

    def __init__(self, config: LocalConfig | None = None) -> None:
        self.config = config or LocalConfig()
        bwrap = shutil.which(self.config.bwrap)
        if bwrap is None:
            raise BackendUnavailable(f"the local sandbox backend needs bubblewrap ({self.config.bwrap!r} is not on "
                                     "PATH): run scripts/setup.sh as root, or apt-get install bubblewrap")
        self.bwrap = bwrap
        if not Path(self.config.python).is_file() or not self.config.python.startswith("/usr/"):
            raise BackendUnavailable(f"the local sandbox backend runs the agent with {self.config.python}, a "
                                     "Python under /usr (the only host folder a sandbox sees): install python3 with "
                                     "the system's package manager")
        # Only the help text matters (it names the options this bubblewrap has), not the exit status.
        help_text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False).stdout
        self.has_size = "--size" in help_text
        self.has_disable_userns = "--disable-userns" in help_text
        self.cgroups = Cgroups.detect() if self.config.use_cgroups and os.geteuid() == 0 else Cgroups({})
        self.privileged = os.geteuid() == 0
        self._free_uids = list(range(self.config.uid_base + self.config.num_uids - 1, self.config.uid_base - 1, -1))
        self._counter = 0
        self._cleanups: set[asyncio.Task[None]] = set()
        for folder in self.config.python_path:
            if not Path(folder).is_dir():
                raise BackendUnavailable(f"setting sandbox_python_path names {folder!r}, which is not a folder here: "
                                         "give folders of Python packages, auto, or nothing")
        log.info("local sandbox backend: %s, cgroup controllers %s, tmpfs size limits %s, python path %s", bwrap,
                 sorted(self.cgroups.roots) or "none (rlimits only)", "yes" if self.has_size else "no",
                 list(self.config.python_path) or "none")
        if not self.privileged and "pids" not in self.cgroups.roots:
            log.warning("local sandbox backend not run as root: sandboxes run as this user, with no process "
                        "limit (RLIMIT_NPROC would count all of this user's processes); run the service as root "
                        "for a user id and a pids cgroup per sandbox")

    def pool_key(self, spec: SandboxSpec) -> tuple[Any, ...]:
        return pool_key(spec)

    def limits(self, spec: SandboxSpec) -> dict[str, int]:
        limits = {"fsize_bytes": spec.disk_mb * MiB, "nofile": 1024}
        if self.privileged:  # a uid of its own: RLIMIT_NPROC counts only the sandbox's processes
            limits["nproc"] = spec.pids + EXTRA_PIDS
        if "memory" not in self.cgroups.roots:
            limits["as_bytes"] = spec.memory_mb * MiB + AGENT_MEMORY_BYTES  # per process: address space, not use
        return limits

    def track(self, cleanup: Awaitable[None]) -> None:
        task = asyncio.ensure_future(cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def release_uid(self, uid: int) -> None:
        self._free_uids.append(uid)

    def argv(self, spec: SandboxSpec, relay: ModelRelay | None = None) -> list[str]:
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
                "--hostname", "sandbox"]
        if spec.network:
            args.append("--share-net")
        if self.has_disable_userns:
            args.append("--disable-userns")
        args += ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = Path("/") / top
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        etc = ["/etc/ld.so.cache", "/etc/alternatives"]
        if spec.network:
            etc += ["/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates"]
        for name in etc:
            args += ["--ro-bind-try", name, name]
        args += ["--proc", "/proc", "--dev", "/dev"]
        if relay is not None:  # the model relay's socket: the sandbox's one way out (relay.py)
            args += ["--ro-bind", str(relay.folder), SOCKET_DIR]
        inside = [f"{PYTHON_PATH_DIR}/{i}" for i in range(len(self.config.python_path))]
        for folder, at in zip(self.config.python_path, inside, strict=True):
            args += ["--ro-bind", folder, at]
        for mount in WRITABLE:
            if self.has_size:
                args += ["--size", str(spec.disk_mb * MiB)]
            args += ["--tmpfs", mount]
        # bubblewrap builds the root (and /dev) as tmpfs the sandbox's user owns: once every
        # mount point is made, both go read-only, so only the tmpfs mounts above take writes.
        args += ["--remount-ro", "/dev", "--remount-ro", "/"]
        args += ["--chdir", WORKDIR, "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                 "--setenv", "HOME", WORKDIR]
        if inside:
            args += ["--setenv", "PYTHONPATH", ":".join(inside)]
        args.append("--")
        return args + agent_argv(self.config.python)

    async def start(self, spec: SandboxSpec) -> LocalBox:
        if spec.image is not None:
            raise SandboxError("invalid_request", f"spec.image={spec.image!r}: the local backend runs the host's "
                                                  "/usr and takes no image; leave image unset, or use the docker "
                                                  "backend (setting sandbox_backend=docker)")
        if not self._free_uids:
            raise SandboxError("capacity", "no free sandbox user id left; destroy sandboxes first")
        uid = self._free_uids.pop()
        self._counter += 1
        cgroup = f"sb-{self._counter}-{uid}"
        try:
            procs = self.cgroups.make(cgroup, spec)
        except OSError as exc:
            self.release_uid(uid)
            raise SandboxError("failed", f"cannot set up the sandbox's cgroups: {exc}") from exc
        privileged = self.privileged
        relay = None
        if spec.model_url is not None:
            try:
                relay = await open_relay(spec.model_url, spec.ttl_s, self.config.relay_dir)
            except SandboxError:
                self.cgroups.kill_and_remove(cgroup)
                self.release_uid(uid)
                raise

        def enter() -> None:  # in the child, before exec: join the cgroups, then become the sandbox's user
            pid = str(os.getpid()).encode()
            for path in procs:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, pid)
                os.close(fd)
            if privileged:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)

        try:
            process = await Child.start(self.argv(spec, relay), enter)
        except BaseException:
            if relay is not None:
                await relay.close()
            raise

        async def write(data: bytes) -> None:
            process.stdin.write(data)
            await process.stdin.drain()

        box = LocalBox(process, AgentChannel(process.stdout.readexactly, write), uid, cgroup, self, relay)
        process.stdin.write(agent_preamble())
        drain = asyncio.ensure_future(_drain(process.stderr, box.stderr_tail))
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                await box.channel.read_frame()
        except (TimeoutError, AgentGone) as exc:
            await box.stop()
            await asyncio.wait([drain], timeout=1.0)  # bubblewrap's last words say what went wrong
            raise start_failed(box.stderr_tail, exc) from exc
        except BaseException:  # cancelled while it started (the service stopping): nothing is left running
            await box.stop()
            raise
        return box

    async def close(self) -> None:
        await asyncio.gather(*self._cleanups)
        self.cgroups.close()


def python_path(setting: str, python: str = "/usr/bin/python3") -> tuple[str, ...]:
    """The folders setting ``sandbox_python_path`` names: ``auto`` is this process's own
    site-packages when ``python`` (the sandbox's) has this Python's minor version (compiled
    packages load then), else none."""
    if setting != "auto":
        return tuple(folder for folder in setting.split(":") if folder)
    try:
        theirs = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ()
    if theirs != str(sys.version_info[:2]):
        log.info("sandbox_python_path=auto: %s is Python %s, this is %s: no packages are shared", python, theirs,
                 sys.version_info[:2])
        return ()
    return tuple(dict.fromkeys(sysconfig.get_path(name) for name in ("purelib", "platlib")))


async def _drain(stream: asyncio.StreamReader | None, tail: bytearray, keep: int = 4096) -> None:
    """Keep the last ``keep`` bytes of a stream (the sandbox's stderr: bubblewrap's errors)."""
    if stream is None:
        return
    while chunk := await stream.read(4096):
        tail += chunk
        del tail[:-keep]


BACKENDS: dict[str, Callable[..., Backend]] = {"local": LocalBackend}
