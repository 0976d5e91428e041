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
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flywheel.contract.settings import SandboxSettings
from flywheel.runtime.isolation import (
    AgentChannel,
    AgentGone,
    Cgroups,
    Child,
    MiB,
    View,
    agent_argv,
    agent_preamble,
    bwrap_argv,
    bwrap_features,
    drain_tail,
)
from flywheel.runtime.relay import SOCKET_DIR, ModelRelay, open_relay
from flywheel.sdk.sandbox import WORKDIR, BuildRequest, Built, SandboxError, SandboxSpec

log = logging.getLogger(__name__)

# Processes (and threads) of the sandbox beyond the spec's: bubblewrap's init, the agent, its
# model forwarder thread (a spec with a model_url), bash.
EXTRA_PIDS = 5
# Memory the agent and bubblewrap need on top of what the spec gives the commands.
AGENT_MEMORY_BYTES = 48 * MiB
# The only places a sandbox can write, each a tmpfs of spec.disk_mb (both backends): WRITABLE;
# /dev/shm is there for POSIX shared memory and semaphores (Python's multiprocessing needs it).
PYTHON_PATH_DIR = "/opt/python"  # where setting sandbox_python_path's folders are bound


class BackendUnavailable(Exception):
    """The backend cannot run here (a program or engine is missing); the message says what to install."""


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

    async def build(self, request: BuildRequest, limits: SandboxSettings) -> Built:
        """The image of ``request``'s context within ``limits``, or a SandboxError saying why not."""

    async def close(self) -> None:
        """Release what the backend holds (cgroup folders); boxes are stopped before."""


def pool_key(spec: SandboxSpec) -> tuple[Any, ...]:
    return (spec.image, spec.cpu, spec.memory_mb, spec.pids, spec.disk_mb, spec.network, spec.model_url)


def start_failed(stderr_tail: bytearray, exc: BaseException) -> SandboxError:
    """The error for a sandbox whose agent never said it was ready: the sandbox's last words."""
    said = bytes(stderr_tail).decode(errors="replace")[-1000:]
    return SandboxError("failed", f"the sandbox did not start: {said or repr(exc)}")


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
        if self.relay is not None:  # first: its folder goes at once, however long the kernel takes to reap
            await self.relay.close()
        await self.process.wait()
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
        try:
            features = bwrap_features(bwrap)
        except RuntimeError as exc:
            raise BackendUnavailable(str(exc)) from None
        self.has_size, self.has_disable_userns, self.has_proc = (features.size, features.disable_userns,
                                                                 features.proc)
        use_cgroups = self.config.use_cgroups and os.geteuid() == 0
        self.cgroups = Cgroups.detect("flywheel-sandbox") if use_cgroups else Cgroups({})
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
        binds: list[tuple[str, str]] = []
        if relay is not None:  # the model relay's socket: the sandbox's one way out (relay.py)
            binds.append((str(relay.folder), SOCKET_DIR))
        inside = [f"{PYTHON_PATH_DIR}/{i}" for i in range(len(self.config.python_path))]
        binds += list(zip(self.config.python_path, inside, strict=True))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR} | (
            {"PYTHONPATH": ":".join(inside)} if inside else {})
        return bwrap_argv(self.bwrap, View(binds=tuple(binds), disk_mb=spec.disk_mb), env,
                          agent_argv(self.config.python), has_size=self.has_size,
                          has_disable_userns=self.has_disable_userns, network=spec.network, has_proc=self.has_proc)

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
            procs = self.cgroups.make(cgroup, spec.memory_mb * MiB + AGENT_MEMORY_BYTES, spec.pids + EXTRA_PIDS,
                                      spec.cpu)
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
        drain = asyncio.ensure_future(drain_tail(process.stderr, box.stderr_tail))
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

    async def build(self, request: BuildRequest, limits: SandboxSettings) -> Built:
        raise SandboxError("unsupported", f"this sandbox service runs the local backend, which runs no images: an "
                                          f"image built from a Dockerfile ({request.dockerfile}) needs the docker "
                                          "backend (run the sandbox service with setting sandbox_backend = "
                                          "\"docker\")")

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


BACKENDS: dict[str, Callable[..., Backend]] = {"local": LocalBackend}
