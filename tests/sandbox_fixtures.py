"""The fixture ``sandbox``: a real sandbox service (local backend) over the test's own nats-server.

For tests anywhere in the tree, environments' included (tests/conftest.py reaches only
tests/): import it into the test module (``from tests.sandbox_fixtures import sandbox``). It
yields a :class:`flywheel.sandbox.SandboxClient`; its ``manager`` holds the service's live
sandboxes, and the fixture checks that none is left when the test ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flywheel.bus import Bus
from flywheel.natsserver import NatsServer
from flywheel.sandbox import SandboxClient
from tests.sandbox_service import backend_named, serving


@pytest.fixture
async def sandbox(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[SandboxClient]:
    server = NatsServer(tmp_path / "nats").start()
    try:
        bus = await Bus.connect(server.url, name="test-sandbox")
        try:
            async with backend_named("local", request) as backend, serving(bus, backend, warm_pool=2,
                                                                           max_alive=16) as client:
                yield client
        finally:
            await bus.close()
    finally:
        server.stop()
