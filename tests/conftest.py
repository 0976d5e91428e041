"""Fixtures shared by every tier. Integration tests get a real nats-server of their own."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from flywheel.runtime.natsserver import NatsServer

if TYPE_CHECKING:
    from flywheel.contract.bus import Bus

# Environment workers see the folders on this process's path, but its working folder only where
# PYTHONPATH names it (it holds a user's own files): the tests' own reward functions and
# environments (tests.*) are imported by workers from this checkout.
REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

# Fixtures defined in modules of their own, for every test under tests/: the docker tier's
# session engine and base image (docker_engine, debian_base) and a real sandbox service
# (sandbox). The environments' tests reach ``sandbox`` through their own conftest.py.
pytest_plugins = ["tests.docker_engine", "tests.sandbox_fixtures"]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server with JetStream on a free port and a temporary store; stopped after."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    from flywheel.contract.bus import Bus

    b = await Bus.connect(nats_server.url, name="test")
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """URL of the PostgreSQL server tests may use (a throwaway database is made per test)."""
    return os.environ.get("FLYWHEEL_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and tokenizer, built once per test session."""
    from flywheel.sdk import models

    return Path(models.resolve_model("tiny", tmp_path_factory.mktemp("data")))


@pytest.fixture
def readable() -> Iterator[Path]:
    """A temporary folder other users may read (pytest's own are closed to them): data that
    environment workers, users of their own, read."""
    folder = Path(tempfile.mkdtemp(prefix="flywheel-readable-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
