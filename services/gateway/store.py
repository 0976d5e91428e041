"""The trace store: every event on the bus, recorded into SQL, and the queries the API serves.

SQLite (one file, the embedded default) or PostgreSQL (deployed), by URL:
``sqlite+aiosqlite:///path/flywheel.db`` or ``postgresql+asyncpg://user@host/db``.
The schema lives in :mod:`flywheel_gateway.schema` and is created by the migrations
(:func:`flywheel_gateway.migrate.migrate`), never by the store.

:class:`Store` is the one object the gateway builds and hands around; each of its jobs is a
part of its own, in a module of its own:

- :mod:`flywheel_gateway.store_db`: the engine, write transactions, strings as stored;
- :mod:`flywheel_gateway.store_pages`: listings a page at a time, keyset cursors;
- :mod:`flywheel_gateway.store_reward`: a rollout's reward and error, in SQL;
- :mod:`flywheel_gateway.store_recording`: events and run states written in;
- :mod:`flywheel_gateway.store_rollouts`: tasks, rollouts, traces, signals and the export read;
- :mod:`flywheel_gateway.store_runs`: runs and their steps read;
- :mod:`flywheel_gateway.store_usage`: usage summed and recounted;
- :mod:`flywheel_gateway.store_hub`: the environment hub's environments, versions, files, evals.

The names the rest of the gateway uses are importable from here. Not covered: deleting or
compacting old traces, full-text search.
"""

from __future__ import annotations

from flywheel_gateway.store_db import create_engine, write_transaction
from flywheel_gateway.store_hub import HubConflict, HubStore
from flywheel_gateway.store_pages import MAX_PAGE_LIMIT, InvalidCursor, encode_cursor
from flywheel_gateway.store_recording import RecordingStore, UnrecordableEvent
from flywheel_gateway.store_reward import shown_error
from flywheel_gateway.store_rollouts import RolloutFilter, RolloutStore
from flywheel_gateway.store_runs import RunStore
from flywheel_gateway.store_usage import UsageStore

__all__ = ["MAX_PAGE_LIMIT", "HubConflict", "InvalidCursor", "RolloutFilter", "Store", "UnrecordableEvent",
           "create_engine", "encode_cursor", "shown_error", "write_transaction"]


class Store(RecordingStore, RolloutStore, RunStore, UsageStore, HubStore):
    """Reads and writes the trace store. Build with :meth:`open`; :meth:`close` when done."""
