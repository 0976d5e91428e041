"""The docker backend: one container per sandbox, through the docker SDK.

Each container runs the agent as its first process (PID 1 of its PID namespace, so a
command cannot kill it with a signal) from the image's ``python3``, with:

- no network (``network_mode=none``); a spec with ``network=True``, which the service
  refuses unless setting ``sandbox_allow_network`` is on, gets the engine's default bridge;
- a read-only root filesystem (``read_only``): writable are only ``/work`` and ``/tmp``
  (tmpfs of ``disk_mb`` each) and ``/dev/shm`` (the engine's shm tmpfs, sized ``disk_mb``);
  ``/dev`` itself is root's and not writable by the sandbox's user;
- memory (swap included), pids and CPU limits from the spec;
- a non-root user (``DockerConfig.user``), every capability dropped, ``no-new-privileges``;
- the agent's rlimits on each command (file size, open files, CPU seconds);
- the image ``sandbox_image`` names, or a spec's own: one a caller built from its Dockerfile
  (``sandbox.build``, images.py) among them;
- with a ``model_url``, the folder of its model relay's socket (``relay.py``) bound read-only
  at :data:`~flywheel_sandbox.relay.SOCKET_DIR`: the engine binds a path of its own host, so
  the relay's folder (setting ``sandbox_relay_dir``) must be one the engine's host sees at
  the same path (the service on that host, or compose's shared bind).

The agent's frames travel over the container's attached stdin/stdout (the engine's
multiplexed stream, demultiplexed here). Destroying a sandbox removes its container with
force (SIGKILL). Not isolated: the kernel is the host's (as for every container), and the
image is whatever ``sandbox_image`` names: it needs ``python3``; a user it can run as is
given by number, so no passwd entry is needed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from flywheel.contract.settings import SandboxSettings
from flywheel.runtime.isolation import AgentChannel, AgentGone, MiB, agent_argv, agent_preamble
from flywheel.runtime.relay import SOCKET_DIR, ModelRelay, open_relay
from flywheel.sdk.sandbox import WORKDIR, BuildRequest, Built, SandboxError, SandboxSpec
from flywheel_sandbox.backends import AGENT_MEMORY_BYTES, EXTRA_PIDS, BackendUnavailable, pool_key, start_failed
from flywheel_sandbox.images import ImageBuilder

log = logging.getLogger(__name__)

STDOUT, STDERR = 1, 2


@dataclass
class DockerConfig:
    image: str  # setting sandbox_image
    base_url: str | None = None  # unset: DOCKER_HOST, else the engine's default socket
    user: str = "65534:65534"  # nobody
    python: str = "python3"
    start_timeout_s: float = 30.0
    labels: dict[str, str] = field(default_factory=lambda: {"flywheel.sdk.sandbox": "1"})
    relay_dir: str | None = None  # setting sandbox_relay_dir: where model relays make their sockets


@dataclass
class DockerBox:
    container: Any
    channel: AgentChannel
    sock: socket.socket
    writer: asyncio.StreamWriter
    demux: asyncio.Task[None]
    backend: DockerBackend
    stderr_tail: bytearray = field(default_factory=bytearray)
    relay: ModelRelay | None = None
    stopped: bool = False

    @property
    def alive(self) -> bool:
        return not self.stopped and not self.demux.done()

    async def stop(self) -> None:
        """Close the stream and remove the container with force (SIGKILL) in the background."""
        if self.stopped:
            return
        self.stopped = True
        self.writer.close()
        self.demux.cancel()
        self.backend.track(self._remove_then_close_relay())

    async def _remove_then_close_relay(self) -> None:
        try:
            await self.backend.run(self._remove)
        finally:
            if self.relay is not None:
                await self.relay.close()

    def _remove(self) -> None:
        import docker.errors

        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:  # auto-removed already
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: removal already in progress
                raise


class DockerBackend:
    name = "docker"

    def __init__(self, config: DockerConfig) -> None:
        import docker
        import docker.errors

        self.config = config
        try:
            self.client = docker.DockerClient(base_url=self.config.base_url) if self.config.base_url \
                else docker.from_env()
            self.client.ping()
        except docker.errors.DockerException as exc:
            raise BackendUnavailable(f"the docker sandbox backend cannot reach a Docker engine "
                                     f"({self.config.base_url or 'DOCKER_HOST or the default socket'}): {exc}") from exc
        try:
            self.client.images.get(self.config.image)
        except docker.errors.ImageNotFound as exc:
            raise BackendUnavailable(f"sandbox image {self.config.image!r} is not in the engine: build it (it needs "
                                     "python3), or set sandbox_image to one that is") from exc
        self._cleanups: set[asyncio.Task[Any]] = set()
        # Its own containers carry this too, so they can be told from other services' (and listed).
        self.owner = secrets.token_hex(8)
        self.labels = {**self.config.labels, "flywheel.sdk.sandbox.owner": self.owner}
        self.builder = ImageBuilder(self.client, self.config.base_url)

    def pool_key(self, spec: SandboxSpec) -> tuple[Any, ...]:
        return pool_key(spec)

    async def build(self, request: BuildRequest, limits: SandboxSettings) -> Built:
        return await self.builder.build(request, limits)

    def limits(self, spec: SandboxSpec) -> dict[str, int]:
        # No RLIMIT_NPROC: every container's user is the same host uid; the pids cgroup limits each one.
        return {"fsize_bytes": spec.disk_mb * MiB, "nofile": 1024}

    async def run(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    def track(self, cleanup: Any) -> None:
        task = asyncio.ensure_future(cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def _create(self, spec: SandboxSpec, relay: ModelRelay | None) -> tuple[Any, socket.socket]:
        memory = spec.memory_mb * MiB + AGENT_MEMORY_BYTES
        tmpfs = f"size={spec.disk_mb}m,mode=1777,exec,nosuid,nodev"  # docker mounts noexec unless told
        container = self.client.containers.create(
            spec.image or self.config.image, agent_argv(self.config.python), stdin_open=True, tty=False,
            user=self.config.user, read_only=True,  # no working_dir: the engine would make /work root's 0755
            tmpfs={WORKDIR: tmpfs, "/tmp": tmpfs}, shm_size=spec.disk_mb * MiB,  # /dev/shm, as on local
            network_mode="bridge" if spec.network else "none", mem_limit=memory, memswap_limit=memory,
            pids_limit=spec.pids + EXTRA_PIDS, nano_cpus=int(spec.cpu * 1e9), cap_drop=["ALL"],
            security_opt=["no-new-privileges"], environment={"HOME": WORKDIR}, hostname="sandbox",
            # auto_remove: gone by itself too when the agent exits (its stdin closes when this service dies)
            labels=self.labels, auto_remove=True,
            volumes={str(relay.folder): {"bind": SOCKET_DIR, "mode": "ro"}} if relay is not None else None)
        assert container.id is not None  # a created container has its id
        try:
            raw = self.client.api.attach_socket(container.id, params={"stdin": 1, "stdout": 1, "stderr": 1,
                                                                      "stream": 1})
            container.start()
        except Exception:
            container.remove(force=True)
            raise
        return container, getattr(raw, "_sock", raw)

    async def start(self, spec: SandboxSpec) -> DockerBox:
        import docker.errors

        relay = None
        if spec.model_url is not None:
            relay = await open_relay(spec.model_url, spec.ttl_s, self.config.relay_dir)
        try:
            container, sock = await self.run(functools.partial(self._create, spec, relay))
        except Exception as exc:
            if relay is not None:
                await relay.close()
            if isinstance(exc, docker.errors.ImageNotFound):
                raise SandboxError("invalid_request",
                                   f"spec.image={spec.image!r}: no such image in the engine") from exc
            if isinstance(exc, docker.errors.APIError):
                raise SandboxError("failed", f"the engine could not start the sandbox: {exc}") from exc
            raise
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        agent_out = asyncio.StreamReader(limit=2**24)
        tail = bytearray()
        demux = asyncio.ensure_future(_demultiplex(reader, agent_out, tail))

        async def write(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        box = DockerBox(container, AgentChannel(agent_out.readexactly, write), sock, writer, demux, self, tail, relay)
        writer.write(agent_preamble())
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                await box.channel.read_frame()
        except (TimeoutError, AgentGone) as exc:
            await box.stop()
            raise start_failed(tail, exc) from exc
        except BaseException:  # cancelled while it started (the service stopping): no container is left running
            await box.stop()
            raise
        return box

    async def close(self) -> None:
        for failure in await asyncio.gather(*self._cleanups, return_exceptions=True):
            if failure is not None:
                log.warning("docker sandbox backend: removing a container failed: %r", failure)
        self.client.close()


async def _demultiplex(reader: asyncio.StreamReader, agent_out: asyncio.StreamReader, tail: bytearray) -> None:
    """Split the engine's attach stream (8-byte headers: stream, 0, 0, 0, size) into the
    agent's stdout and a tail of its stderr."""
    try:
        while True:
            header = await reader.readexactly(8)
            kind, size = header[0], struct.unpack(">I", header[4:])[0]
            payload = await reader.readexactly(size)
            if kind == STDOUT:
                agent_out.feed_data(payload)
            elif kind == STDERR:
                tail += payload
                del tail[:-4096]
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        agent_out.feed_eof()
