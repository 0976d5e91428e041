"""Fixtures of the unit tests: a trace store on SQLite and on PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from flywheel_gateway.migrate import migrate
from flywheel_gateway.store import Store


async def _throwaway_postgres(postgres_url: str) -> AsyncIterator[str]:
    """Create a database on the test server, yield its URL, drop it after."""
    asyncpg = pytest.importorskip("asyncpg")
    admin_dsn = sa.make_url(postgres_url).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        admin = await asyncpg.connect(admin_dsn, timeout=5)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        pytest.skip(f"PostgreSQL at {postgres_url} is unreachable: {exc}")
    name = f"flywheel_test_{uuid.uuid4().hex[:12]}"
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield sa.make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path, postgres_url: str) -> AsyncIterator[str]:
    """An empty database: a SQLite file, or a throwaway PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
        return
    async for url in _throwaway_postgres(postgres_url):
        yield url


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    await migrate(database_url)
    s = Store.open(database_url)
    try:
        yield s
    finally:
        await s.close()
