"""The sandbox service in the test's own process, over the test's real nats-server.

:func:`serving` runs a :class:`SessionManager` and :class:`SandboxResponder` on a given
backend until the block ends, then destroys every sandbox and checks none is left. Tests
talk to it only through :class:`flywheel.sdk.sandbox.SandboxClient`, over NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.settings import SandboxSettings, Settings
from flywheel.sdk.sandbox import SERVICE_NAME, SandboxClient
from flywheel_sandbox import service
from flywheel_sandbox.backends import Backend
from flywheel_sandbox.service import SandboxResponder
from flywheel_sandbox.sessions import ManagerConfig, SessionManager

FLAT = ("max_alive", "max_starting", "warm_pool", "allow_network")  # flat settings sandbox_<name>


def manager_config(**values: Any) -> ManagerConfig:
    """The session manager's config as the service reads it from its settings, with ``values`` set:
    ``max_alive`` is setting sandbox_max_alive, ``max_file_bytes`` is sandbox.max_file_bytes."""
    flat = {f"sandbox_{name}": value for name, value in values.items() if name in FLAT}
    section = SandboxSettings(**{name: value for name, value in values.items() if name not in FLAT})
    return service.manager_config(Settings(**flat, sandbox=section))


@contextlib.asynccontextmanager
async def backend_named(name: str, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The ``local`` backend, or ``docker`` on the session's private engine and Debian base
    image (fixtures of tests/docker_engine.py: skipped with the reason where none starts).
    Typed Any: tests look into the concrete backend's own state (a LocalBackend's cgroups)."""
    docker_backend = None
    backend: Backend
    if name in ("local", "local-rlimits"):  # local-rlimits: as where no cgroup can be made
        from flywheel_sandbox.backends import LocalBackend, LocalConfig

        backend = LocalBackend(LocalConfig(use_cgroups=name == "local"))
    else:
        from flywheel_sandbox.backend_docker import DockerBackend, DockerConfig

        engine = request.getfixturevalue("docker_engine")
        backend = docker_backend = DockerBackend(DockerConfig(image=request.getfixturevalue("debian_base"),
                                                              base_url=engine.host))
    try:
        yield backend
    finally:
        await backend.close()
    if docker_backend is not None:  # every container went with its sandbox
        import docker

        client = docker.DockerClient(base_url=docker_backend.config.base_url)
        label = f"flywheel.sdk.sandbox.owner={docker_backend.owner}"
        try:
            for _ in range(100):  # the engine may still be finishing a removal it was asked for twice
                left = client.containers.list(all=True, filters={"label": label})
                if not left:
                    break
                await asyncio.sleep(0.05)  # noqa: sleep - the polling interval of this bounded wait
            assert not left, [c.status for c in left]
        finally:
            client.close()


class ServedSandboxClient(SandboxClient):
    """A client of the service :func:`serving` runs, holding that service's session manager
    (``manager``) for assertions on the service's own state."""

    def __init__(self, bus: Bus, manager: SessionManager) -> None:
        super().__init__(bus)
        self.manager = manager


@contextlib.asynccontextmanager
async def serving(bus: Bus, backend: Any, instance: str = "test-1", max_in_flight: int | None = None,
                  **config: Any) -> AsyncIterator[ServedSandboxClient]:
    manager = SessionManager(backend, instance, manager_config(**config))
    responder = SandboxResponder(bus, manager, max_in_flight or SandboxSettings().max_requests_in_flight)
    stopping = asyncio.Event()
    tasks = [asyncio.ensure_future(responder.serve(stopping)), asyncio.ensure_future(manager.maintain(stopping))]
    await asyncio.wait_for(responder.ready.wait(), 10)
    # the heartbeat a Service would write: destroy_by_label finds replicas by it
    beat = events.ServiceHeartbeat(service=SERVICE_NAME, instance=instance, pid=os.getpid(), host="test",
                                   started_at=events.utc_now())
    kv = await bus.services_kv()
    await kv.put(f"{SERVICE_NAME}.{instance}", events.encode(beat))
    client = ServedSandboxClient(bus, manager)
    try:
        yield client
    finally:
        stopping.set()
        await asyncio.gather(*tasks)
        await responder.drain()
        await kv.delete(f"{SERVICE_NAME}.{instance}")
        assert not manager.sessions
