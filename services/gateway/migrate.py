"""Bring the trace store's schema to the newest migration, from inside a running event loop.

Both gateway processes (API and recorder) call :func:`migrate` at start, possibly at the
same moment against a fresh database, so the whole upgrade runs in one write transaction
that excludes other migrators: ``BEGIN IMMEDIATE`` on SQLite, a transaction-scoped
advisory lock on PostgreSQL. The second migrator waits, then finds the schema current.

Not covered: downgrades at start (use the ``alembic`` command line, see alembic.ini).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext

from flywheel_gateway.store import create_engine, write_transaction

ALEMBIC_INI = Path(__file__).with_name("alembic.ini")
_MIGRATION_LOCK_KEY = 0x466C7977  # any constant shared by every migrator


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """The Alembic config of the packaged migrations; ``connection`` is used instead of a URL."""
    cfg = Config(str(ALEMBIC_INI))
    cfg.attributes["connection"] = connection
    return cfg


async def run_exclusively(url: str, fn: Callable[[sa.Connection], None]) -> None:
    """Run ``fn`` on a connection, in one write transaction no other migrator runs alongside."""
    engine = create_engine(url)
    try:
        async with write_transaction(engine) as conn:
            if conn.dialect.name == "postgresql":
                await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
            await conn.run_sync(fn)
    finally:
        await engine.dispose()


async def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (idempotent)."""
    await run_exclusively(url, lambda conn: command.upgrade(alembic_config(conn), revision))


async def current_revision(url: str) -> str | None:
    """The revision the database is at (None before the first migration)."""
    revisions: list[str | None] = []
    await run_exclusively(url, lambda conn: revisions.append(MigrationContext.configure(conn).get_current_revision()))
    return revisions[0]
