"""Fixtures shared by the integration tests (tests/conftest.py gives each test its nats-server
and bus, and the sandbox service of tests/sandbox_fixtures.py): the gateway app in process
(and served on HTTP, for streams), inference workers, an inference server on HTTP, and a tiny
model with long prompts. A module may define a fixture of the same name to override one
(test_interception.py builds a shorter model; test_recorder_kill.py and
test_sandbox_service.py have a store and a client of their own)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel.sdk import models
from flywheel_gateway.app import create_app as create_gateway_app
from flywheel_gateway.store import Store
from flywheel_inference.app import create_app as create_inference_app
from flywheel_inference.backends import DecodeSession
from tests.helpers import serving_app, until
from tests.integration.services import Served, Workers

ENVS = Path(__file__).parents[1] / "envs"


# --- the gateway, in process ---------------------------------------------------------------


@pytest.fixture
async def app(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[FastAPI]:
    """The gateway app with its lifespan running."""
    application = create_gateway_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data"))
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client that calls the gateway app in process."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        yield c


@pytest.fixture
async def store(app: FastAPI) -> Store:
    """The gateway app's store."""
    return app.state.store


@pytest.fixture
async def gateway_url(app: FastAPI) -> AsyncIterator[str]:
    """The app (started by the ``app`` fixture) served by uvicorn on a free port: for streams,
    which the ASGI transport does not deliver as they go."""
    async with serving_app(app) as url:
        yield url


# --- inference ------------------------------------------------------------------------------


@pytest.fixture
async def start_worker(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Workers]:
    """Starts inference workers on the test's nats-server; those still running are stopped after."""
    workers = Workers(nats_server.url, tmp_path / "data")
    yield workers
    for _, _, worker in list(workers.started.values()):
        await workers.stop(worker)


@pytest.fixture
async def server(nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Served]:
    """The inference app served over HTTP on a free loopback port (test environments importable)."""
    monkeypatch.syspath_prepend(str(ENVS))
    seen: list[list[int]] = []
    add = DecodeSession.add  # every batch's rows (generate's, and those that join a running batch)

    def recording(self: DecodeSession, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(list(p) for p in prompts)
        return add(self, prompts, *args, **kwargs)

    monkeypatch.setattr(DecodeSession, "add", recording)
    port = free_port()
    app = create_inference_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data"),
                               url=f"http://127.0.0.1:{port}")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.ensure_future(srv.serve())
    await until(lambda: srv.started or serving.done(), timeout_s=30, what="the inference server")
    yield Served(f"http://127.0.0.1:{port}", seen)
    srv.should_exit = True
    await serving


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for tool lists and policies in its prompts (8192 positions)."""
    return models.build_tiny(tmp_path_factory.mktemp("model") / "tiny-8k", max_positions=8192)


@pytest.fixture
async def keyed_app(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[FastAPI]:
    """The gateway with API keys (auth = "keys"), its lifespan running, against the test's
    nats-server; a revoked key shows at once (no cache)."""
    application = create_gateway_app(Settings(nats_url=nats_server.url, data_dir=tmp_path / "data", auth="keys"))
    async with application.router.lifespan_context(application):
        application.state.keys.ttl_s = 0.0
        yield application
