"""A private Docker engine for the docker tier, and a Debian base image made on this machine.

No registry is reachable from the machines these tests run on, and the ``docker`` command
there is only a client. So a test starts its own ``dockerd`` (root only), with no bridge
network and no iptables rules: containers use ``--network none`` or host networking on
loopback. The engine's data root lives in a cache folder reused between runs and between
clones (``FLYWHEEL_DOCKER_CACHE``, default ``~/.cache/flywheel-docker``), so images built
once are found again; its exec root and socket are private temporary folders (short paths:
unix sockets have a 108-byte limit). One engine at a time uses a data root: a second caller
waits on a file lock, then starts its own.

Where no engine can be started (not root, ``dockerd`` missing: ``scripts/setup-docker.sh``
installs it) :class:`EngineUnavailable` says why; the pytest fixtures turn that into a skip.

Not covered: pulling images (no registry), rootless engines, bridge networks.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE_TAG = "flywheel-local/debian-python-bwrap:bookworm"
# python3-venv brings ensurepip, so an image can make a venv with pip and no network.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "bubblewrap")
_READY_TIMEOUT_S = 60.0
_LOCK_TIMEOUT_S = 1800.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _mounts_under(folder: Path) -> list[str]:
    """Mount points inside ``folder``, outermost first (from /proc/self/mountinfo)."""
    prefix = f"{folder}/"
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return sorted(p for p in points if p.startswith(prefix))


class EngineUnavailable(RuntimeError):
    """No Docker engine can be started here; the message says why and what would fix it."""


def cache_dir() -> Path:
    """The folder kept between runs: the engine's data root (images, build cache) lives here."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flywheel-docker"
    return Path(os.environ.get("FLYWHEEL_DOCKER_CACHE") or default).resolve()


def unavailable_reason() -> str | None:
    """Why no engine can be started here, or None when one can be."""
    if os.geteuid() != 0:
        return "starting a Docker engine needs root (dockerd runs as root here)"
    missing = [name for name in ("dockerd", "docker") if shutil.which(name) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH: run scripts/setup-docker.sh (as root) to install docker.io"
    return None


class DockerEngine:
    """One ``dockerd`` process with its own data root, exec root and socket; stop exactly it."""

    def __init__(self, data_root: Path | None = None) -> None:
        self.data_root = (data_root or cache_dir() / "engine").resolve()
        self._run_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock_file: int | None = None
        self._log: BinaryIO | None = None

    @property
    def socket(self) -> Path:
        assert self._run_dir is not None, "engine not started"
        return self._run_dir / "docker.sock"

    @property
    def host(self) -> str:
        """The DOCKER_HOST value that reaches this engine."""
        return f"unix://{self.socket}"

    @property
    def env(self) -> dict[str, str]:
        """The process environment for docker / docker-compose commands against this engine."""
        return {**os.environ, "DOCKER_HOST": self.host}

    @property
    def log_path(self) -> Path:
        return self.data_root.parent / f"{self.data_root.name}.dockerd.log"

    def start(self) -> DockerEngine:
        reason = unavailable_reason()
        if reason:
            raise EngineUnavailable(reason)
        self.data_root.mkdir(parents=True, exist_ok=True)
        self._lock()
        self._run_dir = Path(tempfile.mkdtemp(prefix="fw-dockerd-"))
        self._log = open(self.log_path, "wb")
        # Its own (empty) config file: the machine's /etc/docker/daemon.json is not this engine's.
        (self._run_dir / "daemon.json").write_text("{}\n")
        cmd = [
            "dockerd",
            "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
            f"--data-root={self.data_root}",
            f"--exec-root={self._run_dir / 'exec'}",
            f"--pidfile={self._run_dir / 'dockerd.pid'}",
            f"--host={self.host}",
            f"--config-file={self._run_dir / 'daemon.json'}",
            "--log-driver=json-file",  # `docker logs` works whatever the machine's default
        ]
        # Its own session: a Ctrl-C in the test's terminal reaches the test, which stops it. A
        # test process killed outright takes the engine with it (no orphan holds the data root);
        # the kernel ties that to the starting thread, so only when that is the main thread.
        on_main_thread = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent if on_main_thread else None)  # noqa: PLW1509 - PDEATHSIG is set in the child only
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _lock(self) -> None:
        self._lock_file = os.open(self.data_root.parent / f"{self.data_root.name}.lock", os.O_RDWR | os.O_CREAT)
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"another engine held {self.data_root} for {_LOCK_TIMEOUT_S:.0f}s") from None
                time.sleep(0.5)  # noqa: sleep - polling a lock another test session holds

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                raise EngineUnavailable(f"dockerd exited with {self._proc.returncode}: {self._log_tail()}")
            if self.socket.exists():
                probe = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], env=self.env,
                                       capture_output=True, text=True, timeout=30, check=False)
                if probe.returncode == 0:
                    return
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"dockerd not ready after {_READY_TIMEOUT_S:.0f}s: {self._log_tail()}")
            time.sleep(0.1)  # noqa: sleep - the polling interval of this bounded wait

    def _log_tail(self, num_chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop this engine (SIGTERM, then SIGKILL after ``timeout_s``) and release its data root."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._run_dir is not None:
            # dockerd leaves its network namespace mounted in the exec root when it exits.
            for mount in reversed(_mounts_under(self._run_dir)):
                subprocess.run(["umount", "--lazy", mount], check=True)
            shutil.rmtree(self._run_dir)
            self._run_dir = None
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases the flock
            self._lock_file = None

    def docker(self, *args: str, check: bool = True, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Run the docker client against this engine; on failure the error carries its output."""
        proc = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited {proc.returncode}:\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def image_exists(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, check=False).returncode == 0

    def __enter__(self) -> DockerEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def debian_base_image(engine: DockerEngine, tag: str = BASE_IMAGE_TAG,
                      packages: Sequence[str] = BASE_PACKAGES, suite: str = "bookworm") -> str:
    """A Debian image with python3, made here (``debootstrap --variant=minbase``, ``docker import``).

    Cached by ``tag`` in the engine's data root: the first call takes about a minute, the
    next ones are instant. Returns the tag.
    """
    if engine.image_exists(tag):
        return tag
    if shutil.which("debootstrap") is None:
        raise EngineUnavailable("debootstrap not on PATH: run scripts/setup-docker.sh (as root) to install it")
    with tempfile.TemporaryDirectory(prefix="fw-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        boot = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite,
                               str(rootfs)], capture_output=True, text=True, timeout=900, check=False)
        if boot.returncode != 0:
            raise EngineUnavailable(f"debootstrap {suite} failed ({boot.returncode}): "
                                    f"{boot.stdout[-1500:]}{boot.stderr[-1500:]}")
        # Package lists and caches only make the image bigger.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "--change", 'CMD ["/bin/bash"]', "-", tag],
                                  stdin=tar.stdout, env=engine.env, capture_output=True, text=True, timeout=600,
                                  check=False)
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import {tag} failed: {imported.stderr[-2000:]}")
    return tag


# pytest fixtures (tests/conftest.py registers this module, so every test can ask for them); a test
# using them is skipped with the reason where no engine can be started.

@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """A private Docker engine for the test session (data root cached between runs)."""
    engine = DockerEngine()
    try:
        engine.start()
    except EngineUnavailable as e:
        pytest.skip(f"no Docker engine: {e}")
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def debian_base(docker_engine: DockerEngine) -> str:
    """The tag of the locally made Debian base image with python3 (see :func:`debian_base_image`)."""
    try:
        return debian_base_image(docker_engine)
    except EngineUnavailable as e:
        pytest.skip(f"no local base image: {e}")
