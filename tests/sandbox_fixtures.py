"""The fixture ``sandbox``: a real sandbox service (local backend) over the test's own nats-server,
and :func:`sandboxed_rollout`, an environment's harness run against a scripted model with it.

tests/conftest.py registers this module as a plugin, so every test under tests/ has the
fixture; an environment's tests (which tests/conftest.py does not reach) get it from their
own conftest.py (``from tests.sandbox_fixtures import sandbox``). It yields a
:class:`tests.sandbox_service.ServedSandboxClient`: its ``manager`` holds the service's live
sandboxes, and the fixture checks that none is left when the test ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from flywheel.contract.bus import Bus
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk.sandbox import SandboxClient
from tests.sandbox_service import ServedSandboxClient, backend_named, serving
from tests.scripted_openai import ScriptedOpenAI, ScriptEntry, make_rollout

if TYPE_CHECKING:
    from flywheel.contract import events
    from flywheel.sdk.environment import Environment


@pytest.fixture
async def sandbox(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[ServedSandboxClient]:
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


async def sandboxed_rollout(env: Environment, task: dict[str, Any], script: Sequence[ScriptEntry],
                            client: SandboxClient, rollout_id: str = "test-rollout") -> tuple[events.Rollout,
                                                                                              ScriptedOpenAI]:
    """Run ``env``'s harness on ``task`` against a model playing ``script``, with ``client`` as the
    rollout's sandbox client; the rollout (last request's conversation, final state) and the server."""
    from flywheel.sdk.harness import RolloutContext

    with ScriptedOpenAI({"agent": script}) as server:
        ctx = RolloutContext(task=task, base_url=server.base_url, api_key="test", model="agent",
                             rollout_id=rollout_id, sandbox_client=client)
        try:
            assert env.harness is not None
            await env.harness.run(env, ctx)
        finally:
            await ctx.close()
        return make_rollout(env.name, task, server.conversation("agent"), ctx.state), server
