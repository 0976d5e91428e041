"""A process in a sandbox of its own: what it sees, what it may use, how it starts and how it dies.

The platform runs code it did not write (environments: task sets, harnesses, rewards, tools,
hooks) only in sandboxed processes, never in a process that holds a credential. This module is
how such a process is started, for the environment workers (:mod:`flywheel.runtime.envworker`)
and the programs their harnesses run; the sandbox service's local backend starts its boxes with
the same parts.

The local isolation is bubblewrap, per process:

- its own user, PID, network (only ``lo``: nothing on the host's loopback, no nats-server, no
  gateway, no database), IPC, UTS and cgroup namespaces, and an unprivileged user id of its own
  (:class:`UidLease`) when the host runs as root, so it cannot signal, trace or read the
  host's processes and RLIMIT_NPROC counts only its own;
- a filesystem of read-only binds: the host's ``/usr`` (and its ``/bin``, ``/lib`` links),
  then what a :class:`View` names (the interpreter's packages, an environment's folder), with
  the paths it hides covered by an empty tmpfs (the data dir: its passwords, keys and
  database); three tmpfs mounts of ``disk_mb`` each are the only places it can write
  (``/work``, ``/tmp``, ``/dev/shm``); the root and ``/dev`` go read-only once mounted;
- a clean environment: only the variables it is given (no ``FLYWHEEL_*``, no password);
- cgroup v1 memory, pids and cpu limits where this process may make cgroups, and rlimits
  (open files, file size, no core dumps; address space when no memory cgroup can be made).

Not isolated: the kernel itself (no seccomp filter), and what the view binds (readable).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import functools
import json
import logging
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MiB = 1024 * 1024


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
    async def start(cls, argv: list[str], preexec_fn: Callable[[], None], env: Mapping[str, str] | None = None
                    ) -> Child:
        """``argv`` started with ``env`` (None: this process's environment)."""
        loop = asyncio.get_running_loop()

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                env=env, preexec_fn=preexec_fn)  # noqa: PLW1509  # on purpose: the child joins its cgroups, takes its uid

        spawning = loop.run_in_executor(None, spawn)
        try:
            popen = await asyncio.shield(spawning)
        except asyncio.CancelledError:  # the spawn goes on in its thread: what it starts is killed
            def kill_when_spawned(done: asyncio.Future[subprocess.Popen[bytes]]) -> None:
                if not done.cancelled() and done.exception() is None:
                    kill_and_reap(done.result())

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
            kill_and_reap(popen)
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


def kill_and_reap(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILL a sandboxed process that nothing holds any more, and reap it in a thread."""
    with contextlib.suppress(ProcessLookupError):
        popen.kill()
    threading.Thread(target=popen.wait, name="flywheel-reap", daemon=True).start()


# --- cgroups (v1) -------------------------------------------------------------------------


@dataclass
class Cgroups:
    """Per-sandbox cgroup v1 folders under this process's own cgroup, one per controller found:
    ``<prefix>-<pid>/<name>`` (the sandbox service's are ``flywheel-sandbox-<pid>``)."""

    roots: dict[str, Path]  # controller -> our folder ("<prefix>-<pid>")

    @classmethod
    def detect(cls, prefix: str = "flywheel-sandbox", controllers: tuple[str, ...] = ("memory", "pids", "cpu")
               ) -> Cgroups:
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
                    folder = parent / f"{prefix}-{os.getpid()}"
                    try:
                        folder.mkdir(exist_ok=True)
                    except OSError:
                        continue
                    roots[controller] = folder
                    remove_stale(parent, prefix)
        return cls(roots)

    def make(self, name: str, memory_bytes: int, pids: int, cpu: float) -> list[Path]:
        """A sandbox's folders with its limits written (``cpu`` in cores, 0: no cap); the
        ``cgroup.procs`` files its first process joins."""
        values = {
            "memory": {"memory.limit_in_bytes": memory_bytes},
            "pids": {"pids.max": pids},
            "cpu": {"cpu.cfs_period_us": 100_000, "cpu.cfs_quota_us": int(cpu * 100_000) if cpu > 0 else -1},
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


def remove_stale(parent: Path, prefix: str) -> None:
    """Folders of processes that died without cleaning up (SIGKILL): empty once their
    sandboxes died with them, so removable."""
    for folder in parent.glob(f"{prefix}-*"):
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


async def drain_tail(stream: asyncio.StreamReader | None, tail: bytearray, keep: int = 4096) -> None:
    """Keep the last ``keep`` bytes of a stream (a sandbox's stderr: bubblewrap's errors, a worker's last words)."""
    if stream is None:
        return
    while chunk := await stream.read(4096):
        tail += chunk
        del tail[:-keep]


# --- the agent: the process inside a sandbox that runs its commands (agent.py) ------------------

AGENT_PATH = Path(__file__).parent / "agent.py"
# The agent's source arrives on its stdin ("<length>\n<source>"), then the frames follow.
AGENT_BOOTSTRAP = "import sys; b = sys.stdin.buffer; exec(compile(b.read(int(b.readline())), 'agent.py', 'exec'))"

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



def agent_argv(python: str) -> list[str]:
    """Starts the agent; then send :func:`agent_preamble` on its stdin."""
    return [python, "-I", "-S", "-c", AGENT_BOOTSTRAP]


def agent_preamble() -> bytes:
    source = AGENT_PATH.read_bytes()
    return b"%d\n" % len(source) + source



def decode_b64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def encode_b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# --- user ids ------------------------------------------------------------------------------


class UidLease:
    """An unprivileged user id held by this process until :meth:`release`: ``base`` to ``base +
    count - 1``, each taken with an exclusive lock on a file of its own in ``folder``, so the
    processes of one machine (every service hosting workers, the CLI) never hand out the same
    id twice, and an id comes free when its holder dies (the kernel drops its lock)."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd = fd

    @classmethod
    def take(cls, base: int, count: int, folder: Path) -> UidLease:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        start = os.getpid() % count  # processes start looking in different places
        for i in range(count):
            uid = base + (start + i) % count
            fd = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise RuntimeError(f"no free sandbox user id in {base}..{base + count - 1} (locks in {folder}): too many "
                           "environment workers on this machine; stop some, or widen the range (setting "
                           "workers.num_uids)")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --- what a sandboxed process sees ------------------------------------------------------------

WORKDIR = "/work"
WRITABLE = (WORKDIR, "/tmp", "/dev/shm")  # the only places a sandboxed process can write (tmpfs each)


@dataclass(frozen=True)
class View:
    """The host's folders a sandboxed process sees, besides ``/usr``: ``read_only`` (bound at the
    same path), ``hidden`` (covered by an empty tmpfs where a read-only folder holds them),
    ``binds`` (host path -> path inside, read-only), and the size of each writable tmpfs."""

    read_only: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    binds: tuple[tuple[str, str], ...] = ()
    disk_mb: int = 256


@dataclass(frozen=True)
class Limits:
    """What a sandboxed process tree may use: memory (bytes, the whole tree where a memory cgroup
    can be made, else per process as address space), processes, CPU (cores, where a cpu cgroup
    can be made; 0: no cap), open files."""

    memory_bytes: int
    pids: int
    cpu: float = 0.0
    nofile: int = 4096


def sandbox_python(version: tuple[int, int] = sys.version_info[:2]) -> str | None:
    """A Python of ``version`` under ``/usr`` (the host folder every sandbox sees), or None: this
    interpreter when it is there, else ``/usr/local/bin`` or ``/usr/bin``'s ``pythonX.Y``. It runs
    this interpreter's packages, compiled ones included (same minor version)."""
    here = os.path.realpath(sys.executable)
    if here.startswith("/usr/"):
        return here
    for folder in ("/usr/local/bin", "/usr/bin"):
        candidate = f"{folder}/python{version[0]}.{version[1]}"
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def readable_by_others(path: str) -> bool:
    """Whether a user other than its owner may reach ``path`` (every folder above it searchable by
    others, itself readable): what a sandbox's own user id needs of what it binds."""
    real = Path(os.path.realpath(path))
    for folder in real.parents:
        if not os.stat(folder).st_mode & 0o001:
            return False
    try:
        return bool(os.stat(real).st_mode & 0o004)
    except OSError:
        return False


@dataclass(frozen=True)
class BwrapFeatures:
    """What bubblewrap can do on this machine (:func:`bwrap_features`)."""

    size: bool  # --size: a size limit on each tmpfs
    proc: bool  # a /proc of the sandbox's own PID namespace
    disable_userns: bool  # --disable-userns: no user namespaces made inside the sandbox


@functools.cache
def bwrap_features(bwrap: str) -> BwrapFeatures:
    """Probed once, as an unprivileged user (sandboxes never run as root). In a container
    (Docker's defaults) /proc has masked paths, so the kernel refuses a fresh proc mount in a
    user namespace, and /proc/sys is read-only, so --disable-userns cannot set its limit: sandboxes
    then get no /proc (none of the host's either), and may make user namespaces of their own.
    RuntimeError when bubblewrap cannot make its namespaces at all, saying what the machine needs."""
    def as_nobody() -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)

    def works(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([bwrap, "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", *extra, "true"],
                              capture_output=True, text=True, timeout=30, check=False, env={"PATH": os.defpath},
                              preexec_fn=as_nobody)  # the probe runs as an unprivileged user

    bare = works()
    if bare.returncode != 0:
        raise RuntimeError(f"bubblewrap cannot make its namespaces on this machine: {bare.stderr.strip()[-500:]}. It "
                           "needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
                           "user.max_user_namespaces > 0); in a container, one run without the engine's default "
                           "seccomp and AppArmor profiles (compose/docker-compose.yml: x-workers-security)")
    help_text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False).stdout
    found = BwrapFeatures(size="--size" in help_text, proc=works("--proc", "/proc").returncode == 0,
                          disable_userns="--disable-userns" in help_text
                          and works("--disable-userns").returncode == 0)
    if not found.proc:
        log.warning("bubblewrap cannot mount a fresh /proc here (a container masks parts of its own): sandboxes get "
                    "no /proc")
    if "--disable-userns" in help_text and not found.disable_userns:
        log.warning("bubblewrap cannot use --disable-userns here (/proc/sys is read-only): sandboxes may make user "
                    "namespaces of their own")
    return found


def bwrap_argv(bwrap: str, view: View, env: Mapping[str, str], argv: Sequence[str], *, has_size: bool,
               has_disable_userns: bool, hostname: str = "sandbox", network: bool = False,
               has_proc: bool = True) -> list[str]:
    """bubblewrap's command line for ``argv`` in ``view`` with exactly ``env`` (see the module);
    ``network``: the host's network namespace, loopback services included (a sandbox service
    that allows it, for a spec that asks); ``has_proc``: a /proc of its own PID namespace
    (:func:`bwrap_features`), else none."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--hostname", hostname]
    if network:
        args.append("--share-net")
    if has_disable_userns:
        args.append("--disable-userns")
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        linked = Path("/") / top
        if linked.is_symlink():
            args += ["--symlink", os.readlink(linked), str(linked)]
        elif linked.is_dir():
            args += ["--ro-bind", str(linked), str(linked)]
    etc = ["/etc/ld.so.cache", "/etc/alternatives"]
    if network:
        etc += ["/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates"]
    for name in etc:
        args += ["--ro-bind-try", name, name]
    args += ["--proc", "/proc", "--dev", "/dev"] if has_proc else ["--dev", "/dev"]
    # The writable folders first: a host folder bound below one of them (a checkout under /work)
    # stays visible, read-only, inside it.
    for mount in WRITABLE:
        if has_size:
            args += ["--size", str(view.disk_mb * MiB)]
        args += ["--tmpfs", mount]
    bound: list[str] = []
    for path in sorted(dict.fromkeys(view.read_only), key=len):  # a folder before what is inside it
        if path == "/usr" or path.startswith("/usr/") or any(path.startswith(b + "/") for b in bound):
            continue
        args += ["--ro-bind", path, path]
        bound.append(path)
    for path in view.hidden:
        if os.path.isdir(path) and any(path == b or path.startswith(b + "/") for b in bound):
            args += ["--tmpfs", path]
    for source, target in view.binds:
        args += ["--ro-bind", source, target]
    # bubblewrap builds the root (and /dev) as tmpfs the sandbox's user owns: once every mount
    # point is made, both go read-only, so only the tmpfs mounts above take writes.
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return [*args, "--", *argv]


# --- starting one ---------------------------------------------------------------------------------


@dataclass
class Sandboxed:
    """A started sandboxed process: its pipes (:class:`Child`), and what it holds (its user id
    and cgroup), given back by :meth:`stop`."""

    child: Child
    stderr_tail: bytearray
    release: Callable[[], bool]  # gives back what it held; False while its cgroup still has members
    _drain: asyncio.Task[None] | None = None
    _stopped: bool = False

    @property
    def pid(self) -> int:
        return self.child.popen.pid

    @property
    def alive(self) -> bool:
        return not self._stopped and self.child.returncode is None

    @property
    def returncode(self) -> int | None:
        return self.child.returncode

    async def wait(self) -> int:
        return await self.child.wait()

    def last_words(self) -> str:
        """The end of what it wrote on stderr."""
        return bytes(self.stderr_tail).decode(errors="replace").strip()[-2000:]

    async def stop(self) -> None:
        """SIGKILL the whole tree (bubblewrap's PID namespace dies with it), wait for it, give back
        its user id and cgroup. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.child.kill()
        await self.child.wait()
        if self._drain is not None:
            await asyncio.wait([self._drain], timeout=1.0)
        for _ in range(400):  # the kernel reaps the tree's last members a moment after bubblewrap
            if self.release():
                return
            await asyncio.sleep(0.005)  # polling interval while the kernel reaps the members
        log.warning("sandboxed process %d: its cgroup still has members after kill", self.pid)


class Isolation:
    """How sandboxed processes start on this machine: bubblewrap (``bubblewrap``), or, where an
    operator said so for a machine without it, none (``none``: a plain child process with only
    the given environment and the rlimits; it sees the host's files)."""

    def __init__(self, kind: str = "bubblewrap", *, uid_base: int = 300_000, num_uids: int = 4096,
                 uid_folder: Path | None = None, cgroup_prefix: str = "flywheel-workers") -> None:
        if kind not in ("bubblewrap", "none"):
            raise ValueError(f"isolation {kind!r}: one of bubblewrap, none")
        self.kind = kind
        self.privileged = os.geteuid() == 0
        self.uid_base, self.num_uids = uid_base, num_uids
        self.uid_folder = uid_folder or Path(tempfile.gettempdir()) / "flywheel-uids"
        self.cgroups = Cgroups({})
        self.bwrap = ""
        self.has_size = self.has_disable_userns = False
        self.has_proc = True
        self._counter = 0
        if kind == "bubblewrap":
            found = shutil.which("bwrap")
            if found is None:
                raise RuntimeError("environment workers run in bubblewrap, which is not on PATH: install it "
                                   "(scripts/setup.sh as root, or apt-get install bubblewrap), or, on a machine "
                                   "only you use with code you trust, set workers.isolation = \"none\"")
            self.bwrap = found
            features = bwrap_features(found)
            self.has_size, self.has_disable_userns, self.has_proc = (features.size, features.disable_userns,
                                                                     features.proc)
            if self.privileged:
                self.cgroups = Cgroups.detect(cgroup_prefix)

    async def start(self, argv: Sequence[str], env: Mapping[str, str], view: View, limits: Limits,
                    name: str = "worker") -> Sandboxed:
        """``argv`` started in a sandbox of its own (or as a plain child, with isolation ``none``)."""
        lease = UidLease.take(self.uid_base, self.num_uids, self.uid_folder) if (
            self.kind == "bubblewrap" and self.privileged) else None
        self._counter += 1
        cgroup = f"{name}-{os.getpid()}-{self._counter}"
        procs = self.cgroups.make(cgroup, limits.memory_bytes, limits.pids, limits.cpu) if lease else []
        rlimits = {resource.RLIMIT_NOFILE: limits.nofile, resource.RLIMIT_CORE: 0,
                   resource.RLIMIT_FSIZE: view.disk_mb * MiB}
        if "memory" not in self.cgroups.roots:
            rlimits[resource.RLIMIT_AS] = limits.memory_bytes
        if lease is not None:  # a user id of its own: RLIMIT_NPROC counts only its processes
            rlimits[resource.RLIMIT_NPROC] = limits.pids
        uid = lease.uid if lease is not None else None

        def enter() -> None:  # in the child, before exec: join the cgroups, set limits, become its user
            pid = str(os.getpid()).encode()
            for path in procs:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, pid)
                os.close(fd)
            for which, value in rlimits.items():
                resource.setrlimit(which, (value, value))
            if uid is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)

        if self.kind == "bubblewrap":
            full = bwrap_argv(self.bwrap, view, env, argv, has_size=self.has_size,
                              has_disable_userns=self.has_disable_userns, hostname=name, has_proc=self.has_proc)
        else:
            full = list(argv)

        def release() -> bool:
            if procs and not self.cgroups.kill_and_remove(cgroup):
                return False
            if lease is not None:
                lease.release()
            return True

        try:
            # bubblewrap itself gets nothing of this process's environment either (--clearenv is for inside).
            child = await Child.start(full, enter, env={"PATH": os.defpath} if self.kind == "bubblewrap" else env)
        except BaseException:
            release()  # nothing was started in its cgroup
            raise
        tail = bytearray()
        started = Sandboxed(child, tail, release)
        started._drain = asyncio.ensure_future(drain_tail(child.stderr, tail))
        return started

    def close(self) -> None:
        self.cgroups.close()
