"""The trace store's database: the engine, write transactions, and strings as the database stores them.

SQLite (one file, the embedded default) or PostgreSQL (deployed), by URL:
``sqlite+aiosqlite:///path/flywheel.db`` or ``postgresql+asyncpg://user@host/db``.

SQLite: WAL, a busy timeout, write transactions start with ``BEGIN IMMEDIATE`` (so a writer
never fails on a lock upgrade) and writers of one process take turns on an asyncio lock instead
of spinning in SQLite's busy handler; each runs whole on a thread, through a blocking engine on
the same file (:class:`_SqliteWrites`), while reads go through aiosqlite. PostgreSQL: write
transactions run in the event loop on connections of the pool, beside each other (their locks:
:mod:`flywheel_gateway.store_recording`).

PostgreSQL refuses NUL characters in text and JSONB, and a model can sample one: on
PostgreSQL every NUL in a recorded string becomes U+FFFD (the replacement character), so the
event is recorded instead of failing for ever; SQLite stores it as it is. The bus keeps the
original. :class:`StoreBase` is what every part of the store (:mod:`flywheel_gateway.store`)
builds on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Self, TypeVar

import msgspec
import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

SQLITE_BUSY_TIMEOUT_MS = 30_000

# Ids per statement for IN (...) lists; well below SQLite's and asyncpg's parameter limits.
_IN_CHUNK = 500
_WRITE = "flywheel_write"


_T = TypeVar("_T")


def _without_nul(value: Any) -> Any:
    """``value`` with every NUL character in its strings (keys too) replaced by U+FFFD."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nul(v) for v in value]
    if isinstance(value, msgspec.Struct):  # an event or a part of one, stored as JSON
        return _without_nul(msgspec.to_builtins(value))
    return value


def _json_dumps(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def create_engine(url: str) -> AsyncEngine:
    """An async engine for the trace store, with SQLite tuned for one writer and many readers."""
    backend = sa.make_url(url).get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(f"database_url must be sqlite+aiosqlite://... or postgresql+asyncpg://..., got {url!r}")
    if backend == "sqlite":
        database = sa.make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, json_serializer=_json_dumps, json_deserializer=msgspec.json.decode)
    if backend == "sqlite":
        _tune_sqlite(engine.sync_engine)
    return engine


def _blocking_sqlite_engine(engine: AsyncEngine) -> sa.Engine:
    """A blocking (pysqlite) engine on ``engine``'s SQLite database, tuned alike."""
    blocking = sa.create_engine(engine.url.set(drivername="sqlite"), json_serializer=_json_dumps,
                                json_deserializer=msgspec.json.decode)
    _tune_sqlite(blocking)
    return blocking


def _tune_sqlite(engine: sa.Engine) -> None:
    @sa_event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy emit BEGIN itself (below), so DDL and reads are transactional too.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL mode
        cursor.close()

    @sa_event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")


@asynccontextmanager
async def write_transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A transaction that will write: on SQLite it takes the write lock at BEGIN."""
    async with engine.connect() as base:
        conn = await base.execution_options(**{_WRITE: True})
        async with conn.begin():
            yield conn


def in_chunks(items: Sequence[str], size: int = _IN_CHUNK) -> Iterable[Sequence[str]]:
    """``items`` a statement's IN list at a time."""
    for i in range(0, len(items), size):
        yield items[i:i + size]


def columns_of(table: sa.Table, *leave_out: str) -> list[sa.Column[Any]]:
    """The columns of ``table`` that readers get: all but ``seq`` (the order of recording) and ``leave_out``."""
    return [c for c in table.c if c.name != "seq" and c.name not in leave_out]


class _SqliteWrites:
    """SQLite's write transactions, one at a time, each run whole on a thread, on a blocking
    (pysqlite) engine on the database the store reads through aiosqlite.

    aiosqlite hands every DBAPI call (a cursor, an execute, its close, the commit) to its
    thread and back, ten to thirty handoffs a recorder's transaction, and they cost more CPU
    than its statements; here a transaction costs one. Writers of this process
    queue on an asyncio lock, not in SQLite's busy handler. A writer cancelled while its
    transaction runs leaves the queue at once and the thread finishes the transaction (a
    write that follows waits for it in the busy handler), as aiosqlite finished the call in
    flight. An in-memory database exists only on its own engine's connection, so its writes
    stay on the async engine.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.lock = asyncio.Lock()
        self.engine = engine
        self.blocking = None if engine.url.database in (None, "", ":memory:") else _blocking_sqlite_engine(engine)

    async def run(self, write: Callable[[sa.Connection], _T]) -> _T:
        async with self.lock:
            if self.blocking is None:
                async with write_transaction(self.engine) as conn:
                    return await conn.run_sync(write)
            return await asyncio.to_thread(self._transaction, self.blocking, write)

    @staticmethod
    def _transaction(blocking: sa.Engine, write: Callable[[sa.Connection], _T]) -> _T:
        with blocking.connect() as conn, conn.execution_options(**{_WRITE: True}).begin():
            return write(conn)

    async def close(self) -> None:
        async with self.lock:  # after the write in progress
            if self.blocking is not None:
                self.blocking.dispose()


class StoreBase:
    """The store's engine and how its parts write and look up strings. Build with :meth:`open`;
    :meth:`close` when done."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        self._sqlite_writes = _SqliteWrites(engine) if self.dialect == "sqlite" else None

    @classmethod
    def open(cls, url: str) -> Self:
        return cls(create_engine(url))

    async def close(self) -> None:
        if self._sqlite_writes is not None:
            await self._sqlite_writes.close()
        await self.engine.dispose()

    async def ping(self) -> None:
        """Raise if the database cannot answer a trivial query."""
        async with self.engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))

    async def _write(self, write: Callable[[sa.Connection], _T]) -> _T:
        """Run ``write`` in a write transaction and return what it returns: on SQLite on a thread
        (see :class:`_SqliteWrites`), on PostgreSQL in the event loop, its statements awaited on
        a connection of the pool (``run_sync``), beside other writers."""
        if self._sqlite_writes is not None:
            return await self._sqlite_writes.run(write)
        async with write_transaction(self.engine) as conn:
            return await conn.run_sync(write)

    def _storable(self, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``values`` as this database can store them (PostgreSQL: no NUL characters)."""
        return [_without_nul(v) for v in values] if self.dialect == "postgresql" else values

    def _text(self, value: str) -> str:
        """A string to look up as it was stored: on PostgreSQL, NUL became U+FFFD (and a NUL in a
        query parameter would be refused by the database)."""
        return _without_nul(value) if self.dialect == "postgresql" else value

    def _texts(self, values: Iterable[str]) -> list[str]:
        return [self._text(v) for v in values]
