"""The trace store: every event on the bus, recorded into SQL, and the queries the API serves.

SQLite (one file, the embedded default) or PostgreSQL (deployed), by URL:
``sqlite+aiosqlite:///path/flywheel.db`` or ``postgresql+asyncpg://user@host/db``.
The schema lives in :mod:`flywheel_gateway.schema` and is created by the migrations
(:func:`flywheel_gateway.migrate.migrate`), never by this module.

Recording is idempotent and bulk: :meth:`Store.record` takes a batch of events of any
kinds, and writes them in one transaction with one ``executemany`` per table, every insert
``ON CONFLICT DO NOTHING`` (keyed by event id), so a redelivered event changes nothing; the
rollouts' insert returns the ones that are new, and a run this process has seen recorded is
not inserted again (nothing deletes a run). Recording's statements are built once, so that
the compiled statement cache serves each batch without building and keying it again.
A rollout's graph (``rollout_nodes``) grows from its live trace nodes while it runs; once
the rollout is recorded it is exactly the nodes the rollout lists, in its order: live nodes
of an attempt inference abandoned (killed mid-rollout, the task redelivered and rolled out
again under the same rollout id) are dropped then, and live nodes that arrive later are
ignored, whichever consumer is first.
A rollout's reward is the one definition every reader uses
(:func:`flywheel.sdk.scoring.rollout_reward`), computed in SQL (:func:`reward_expression`):
the weighted sum of the values of its run's scorers (``run_scorers``, mirrored from the
run's ``RunState.scorers``, or from ``RunState.env_scorers`` those of the rollout's
environment in a run with several; a score of any other scorer counts for nothing), null
until each of them has scored it, when one failed on it, and when the rollout is an error; a
rollout whose scorers are not known counts every score at its own weight. It is recomputed in
the same transaction whenever the rollout (its first copy) or one of its scores is recorded,
and for the run's rollouts its scorers apply to when they change, so the order in which they
arrive does not matter, and filters on it run in SQL. A weight update
also gives its run's metrics for its training step (``run_metrics``; the first update of a
step wins).

Concurrency. SQLite: WAL, a busy timeout, write transactions start with
``BEGIN IMMEDIATE`` (so a writer never fails on a lock upgrade) and writers of one process
take turns on an asyncio lock instead of spinning in SQLite's busy handler; each runs whole
on a thread, through a blocking engine on the same file (:class:`_SqliteWrites`), while
reads go through aiosqlite. PostgreSQL:
a write transaction first takes transaction-scoped advisory locks on the runs it touches
(shared; a change of a run's scorers takes its lock exclusively) and then on the rollouts
it touches (each in a fixed order), so a score and its rollout recorded at the same moment
by two consumers, or a rollout and its run's scorers, cannot miss each other when the
reward is computed.

Reading: listings page newest first with a keyset cursor on ``seq`` (rows recorded
meanwhile never shift a page); a rollout cursor carries a digest of its filters, so it
cannot continue another listing. The export reads a page at a time and releases its
connection before handing the page out.

PostgreSQL refuses NUL characters in text and JSONB, and a model can sample one: on
PostgreSQL every NUL in a recorded string becomes U+FFFD (the replacement character), so the
event is recorded instead of failing for ever; SQLite stores it as it is. The bus keeps the
original. Not covered: deleting or compacting old traces, full-text search.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from flywheel.contract import events
from flywheel.contract.hub import HubRefused, project_name, semver_key
from flywheel.sdk.tracegraph import ROWS, final_branch, join_tokens
from flywheel_gateway import schema as s
from flywheel_gateway.hub import Package

SQLITE_BUSY_TIMEOUT_MS = 30_000
MAX_PAGE_LIMIT = 1000
# Ids per statement for IN (...) lists; well below SQLite's and asyncpg's parameter limits.
_IN_CHUNK = 500
_WRITE = "flywheel_write"
_RUN_LOCK_CLASS = 0x52554E53  # the first key of a run's advisory lock (the two-key space, apart from rollouts')


_T = TypeVar("_T")


class InvalidCursor(ValueError):
    """A pagination cursor that this store did not hand out (or for another listing)."""


class HubConflict(ValueError):
    """A hub version (or package file) that exists already: versions are immutable."""


def _like_prefix(text: str) -> str:
    """``text`` with LIKE's wildcards escaped (escape character '\\')."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class UnrecordableEvent(ValueError):
    """An event that can never be recorded as it is (retrying will not help)."""


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


@dataclass
class Page:
    """One page of a listing; ``next_cursor`` is None on the last page."""

    items: list[dict[str, Any]]
    next_cursor: str | None


@dataclass
class RolloutFilter:
    """Filters of the rollout listing and export; None means no filter.

    Reward and policy-version bounds are inclusive; a reward bound leaves out rollouts
    without a reward (not scored yet, or a scorer failed on them). ``created_after`` is
    inclusive and ``created_before`` exclusive, so consecutive windows never overlap.
    ``error``: True keeps rollouts with an error (inference marked them ``error`` or gave an
    error message, or a scorer failed on them), False keeps the others; a rollout read from
    the store has its ``error`` say why (:func:`shown_error`), so the two agree.
    """

    run: str | None = None
    env: str | None = None
    env_aliases: tuple[str, ...] | None = None  # env's other ids: its rollouts are of runs configured with these too
    status: str | None = None
    error: bool | None = None
    flagged: bool | None = None  # flagged by the reward-hacking watch (a score of the scorer 'watch')
    tenant: str | None = None  # only the runs of this tenant
    policy_version: int | None = None
    min_policy_version: int | None = None
    max_policy_version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None

    def where(self) -> list[sa.ColumnElement[bool]]:
        c = s.rollouts.c
        conditions = [
            (self.run, lambda v: c.run == v),
            (self.env, lambda v: _of_env(v, self.env_aliases or ())),
            (self.status, lambda v: c.status == v),
            (self.tenant, lambda v: c.run.in_(sa.select(s.runs.c.id).where(s.runs.c.tenant == v))),
            (self.error, lambda v: _has_error() if v else sa.not_(_has_error())),
            (self.flagged, lambda v: _flagged(c.id) if v else sa.not_(_flagged(c.id))),
            (self.policy_version, lambda v: c.policy_version == v),
            (self.min_policy_version, lambda v: c.policy_version >= v),
            (self.max_policy_version, lambda v: c.policy_version <= v),
            (self.min_reward, lambda v: c.reward >= v),
            (self.max_reward, lambda v: c.reward <= v),
            (self.created_after, lambda v: c.created_at >= v),
            (self.created_before, lambda v: c.created_at < v),
        ]
        return [make(value) for value, make in conditions if value is not None]

    def fingerprint(self) -> str:
        """A short digest of the filters, carried in cursors: a cursor only continues its own listing."""
        return fingerprint(asdict(self))


def fingerprint(filters: dict[str, Any]) -> str:
    """A short digest of a listing's filters (those set), carried in its cursors (see ``Store._page``)."""
    chosen = {k: v.astimezone(UTC) if isinstance(v, datetime) else v for k, v in sorted(filters.items())
              if v is not None}
    return hashlib.sha256(msgspec.json.encode(chosen)).hexdigest()[:16]


def _failed_score(rollout_id: sa.ColumnElement[str]) -> sa.Exists:
    sc = s.scores.c
    return sa.exists().where(sc.rollout_id == rollout_id, sc.error.is_not(None))


def _flagged(rollout_id: sa.ColumnElement[str]) -> sa.Exists:
    sc = s.scores.c
    return sa.exists().where(sc.rollout_id == rollout_id, sc.scorer == events.WATCH_SCORER)


def _is_env_id(column: sa.ColumnElement[Any], env_ids: Sequence[str]) -> sa.ColumnElement[bool]:
    """``column`` holds one of ``env_ids``, or it with ``@VERSION`` (an id without a version takes any)."""
    return sa.or_(*(sa.or_(column == env_id, column.startswith(f"{env_id}@", autoescape=True)) for env_id in env_ids))


def _of_env(env: str, aliases: Sequence[str]) -> sa.ColumnElement[bool]:
    """Rollouts of ``env``: the name in their subjects, or the id their run was configured with
    (the run's one, or in a run of several this rollout's environment's), ``env`` or one of
    ``aliases``, its other ids (a hub id's module, a module's hub id)."""
    c, ids = s.rollouts.c, [env, *aliases]
    return sa.or_(c.env == env, c.run.in_(sa.select(s.runs.c.id).where(_is_env_id(s.runs.c.env, ids))),
                  sa.exists().where(s.run_envs.c.run == c.run, s.run_envs.c.env == c.env,
                                    _is_env_id(s.run_envs.c.env_id, ids)))


def _has_error() -> sa.ColumnElement[bool]:
    c = s.rollouts.c
    return sa.or_(c.status == "error", c.error.is_not(None), _failed_score(c.id))


def shown_error(status: str, error: str | None, scores: Iterable[Mapping[str, Any]]) -> str | None:
    """A rollout's ``error`` as the API shows it: why :func:`_has_error` holds (inference's
    message, then each failed scorer's), None where it does not. The filter ``error=true``
    also keeps rollouts a scorer failed on and those inference marked ``error`` without a
    message; the rollout's own message alone would show them as null."""
    whys = [error] if error else []
    whys += [f"scorer {sc['scorer']!r} failed: {sc['error']}" for sc in scores if sc["error"] is not None]
    if not whys and (status == "error" or error is not None):
        whys = ["inference marked the rollout an error without a message"]
    return "; ".join(whys) or None


# Cursor keys as the database columns take them: seq is 64-bit, times are aware (UTC).
_Seq = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
_AwareDatetime = Annotated[datetime, msgspec.Meta(tz=True)]


def encode_cursor(listing: str, *key: Any) -> str:
    """A cursor: the listing's name and the sort key of the last row handed out."""
    return base64.urlsafe_b64encode(msgspec.json.encode([listing, *key])).decode().rstrip("=")


def decode_cursor(listing: str, cursor: str, key_types: tuple[Any, ...] = (_Seq,)) -> tuple[Any, ...]:
    """The sort key in ``cursor``, typed by ``key_types``; InvalidCursor when it is not one of ``listing``'s."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        kind, *key = msgspec.json.decode(raw, type=list)
        if kind == listing:
            key_type = tuple[key_types]  # type: ignore[valid-type]  # a tuple type built at run time, for msgspec
            typed: tuple[Any, ...] = msgspec.convert(key, key_type)
            for value in typed:
                if isinstance(value, datetime):
                    value.astimezone(UTC)  # OverflowError outside years 1 to 9999 in UTC
            return typed
    except (binascii.Error, ValueError, TypeError, OverflowError, msgspec.DecodeError) as exc:
        raise InvalidCursor(f"cursor {cursor!r} is not a cursor this API handed out") from exc
    raise InvalidCursor(f"cursor {cursor!r} belongs to the {kind} listing, not {listing}")


def _before(order: Sequence[sa.Column[Any]], key: Sequence[Any]) -> sa.ColumnElement[bool]:
    """Rows after ``key`` in descending ``order``: (a, b) < (ka, kb), spelled out for every database."""
    column, value = order[0], key[0]
    if len(order) == 1:
        return column < value
    return sa.or_(column < value, sa.and_(column == value, _before(order[1:], key[1:])))


# --- turning events into rows ---------------------------------------------------------------


@dataclass
class _Rows:
    """The rows one batch of events adds, per table, deduplicated by primary key."""

    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    rollout_nodes: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    trace_links: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    scores: dict[str, dict[str, Any]] = field(default_factory=dict)
    signals: dict[str, dict[str, Any]] = field(default_factory=dict)
    weight_updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    run_metrics: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    dead_letters: dict[str, dict[str, Any]] = field(default_factory=dict)
    usage: dict[str, dict[str, Any]] = field(default_factory=dict)
    rollout_usage: dict[str, dict[str, Any]] = field(default_factory=dict)  # by rollout: kept if it is new
    trained_rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, event: events.Event) -> None:
        adder = _ADDERS.get(type(event))
        if adder is None:
            raise UnrecordableEvent(f"the trace store does not record {type(event).__name__} events")
        if event.created_at.tzinfo is None:
            raise UnrecordableEvent(f"{type(event).__name__} {event.id!r}: created_at {event.created_at.isoformat()} "
                                    "has no time zone; send RFC 3339 with an offset, e.g. 2026-01-01T00:00:00Z")
        run = getattr(event, "run", None)
        if run is not None:
            self.runs.setdefault(run, {"id": run, "tenant": "default", "kind": "train", "created_at": event.created_at})
        adder(self, event)

    def add_task(self, t: events.Task) -> None:
        self.tasks.setdefault(t.id, {
            "id": t.id, "run": t.run, "env": t.env, "data": t.data, "num_rollouts": t.num_rollouts,
            "sampling": t.sampling, "created_at": t.created_at,
        })

    def add_rollout(self, r: events.Rollout) -> None:
        if r.id in self.rollouts:
            return
        self.rollouts[r.id] = {
            "id": r.id, "run": r.run, "env": r.env, "task_id": r.task_id, "group_id": r.group_id,
            "index": r.index, "policy_version": r.policy_version, "status": r.status, "error": r.error,
            "num_tokens": sum(len(n.tokens.token_ids) for n in r.nodes if n.tokens is not None),
            "created_at": r.created_at, "event": r,
        }
        for position, node in enumerate(r.nodes):
            self._add_node(node)
            self.rollout_nodes.setdefault((r.id, node.id),
                                          {"rollout_id": r.id, "node_id": node.id, "position": position})
        if r.usage is not None:
            u = r.usage
            self.rollout_usage[r.id] = _usage_row(
                f"rollout.{r.id}", r.run, "rollout", r.created_at, rollout_id=r.id, num_calls=u.num_calls,
                prompt_tokens=u.prompt_tokens, sampled_tokens=u.sampled_tokens)

    def add_usage(self, u: events.Usage) -> None:
        self.usage.setdefault(u.id, _usage_row(
            u.id, u.run, u.source, u.created_at, tenant=u.tenant or None, step=u.step, prompt_tokens=u.prompt_tokens,
            sampled_tokens=u.sampled_tokens, trained_tokens=u.trained_tokens, sft_tokens=u.sft_tokens,
            sandbox_s=u.sandbox_s, rollout_id=u.rollout_id))
        for rollout_id in u.rollout_ids:
            self.trained_rollouts.setdefault(rollout_id, {"rollout_id": rollout_id, "run": u.run, "step": u.step or 0})

    def add_trace_node(self, t: events.TraceNode) -> None:
        self._add_node(t.node)
        self.trace_links.setdefault((t.rollout_id, t.node.id), {"rollout_id": t.rollout_id, "node_id": t.node.id})

    def _add_node(self, n: events.Node) -> None:
        self.nodes.setdefault(n.id, {
            "id": n.id, "parent_id": n.parent_id, "role": n.message.role, "message": n.message,
            "tokens": n.tokens, "policy_version": n.tokens.policy_version if n.tokens is not None else None,
        })

    def add_score(self, sc: events.Score) -> None:
        self.scores.setdefault(sc.id, {
            "id": sc.id, "run": sc.run, "env": sc.env, "rollout_id": sc.rollout_id, "group_id": sc.group_id,
            "scorer": sc.scorer, "value": sc.value, "weight": sc.weight, "components": sc.components,
            "error": sc.error, "created_at": sc.created_at,
        })

    def add_signal(self, sg: events.Signal) -> None:
        self.signals.setdefault(sg.id, {
            "id": sg.id, "run": sg.run, "env": sg.env, "rollout_id": sg.rollout_id, "source": sg.source,
            "model": sg.model, "temperature": sg.temperature, "values": sg.values, "error": sg.error,
            "created_at": sg.created_at,
        })

    def add_weight_update(self, w: events.WeightUpdate) -> None:
        self.weight_updates.setdefault(w.id, {
            "id": w.id, "run": w.run, "version": w.version, "uri": w.uri, "sha256": w.sha256,
            "size_bytes": w.size_bytes, "format": w.format, "trainer_step": w.trainer_step, "created_at": w.created_at,
        })
        self.run_metrics.setdefault((w.run, w.trainer_step), {
            "run": w.run, "step": w.trainer_step, "version": w.version, "metrics": w.metrics,
            "created_at": w.created_at,
        })

    def add_dead_letter(self, d: events.DeadLetter) -> None:
        self.dead_letters.setdefault(d.id, {
            "id": d.id, "stream": d.stream, "original_subject": d.original_subject, "consumer": d.consumer,
            "num_delivered": d.num_delivered, "reason": d.reason, "payload": d.payload, "headers": d.headers,
            "created_at": d.created_at,
        })

    def touched_rollouts(self) -> list[str]:
        """Rollouts whose reward or graph this batch may change, sorted (the lock order): recorded,
        scored, or given live trace nodes."""
        return sorted(set(self.rollouts).union((row["rollout_id"] for row in self.scores.values()),
                                               (rollout_id for rollout_id, _ in self.trace_links)))


_ADDERS: dict[type, Any] = {
    events.Task: _Rows.add_task,
    events.Rollout: _Rows.add_rollout,
    events.TraceNode: _Rows.add_trace_node,
    events.Score: _Rows.add_score,
    events.Signal: _Rows.add_signal,
    events.WeightUpdate: _Rows.add_weight_update,
    events.DeadLetter: _Rows.add_dead_letter,
    events.Usage: _Rows.add_usage,
}


def _usage_row(id: str, run: str, source: str, created_at: datetime, tenant: str | None = None,
               step: int | None = None, rollout_id: str | None = None, num_calls: int = 0, prompt_tokens: int = 0,
               sampled_tokens: int = 0, trained_tokens: int = 0, sft_tokens: int = 0,
               sandbox_s: float = 0.0) -> dict[str, Any]:
    return {"id": id, "run": run, "source": source, "tenant": tenant, "step": step, "rollout_id": rollout_id,
            "num_calls": num_calls, "prompt_tokens": prompt_tokens, "sampled_tokens": sampled_tokens,
            "trained_tokens": trained_tokens, "sft_tokens": sft_tokens, "sandbox_s": sandbox_s,
            "created_at": created_at}


def _chunks(items: Sequence[str], size: int = _IN_CHUNK) -> Iterable[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _ids() -> sa.BindParameter[Any]:
    """An IN list bound at execution, as ``ids``: one statement object serves every batch."""
    return sa.bindparam("ids", expanding=True)


# The tables recording inserts into with executemany, every row ON CONFLICT DO NOTHING.
_RECORDED_TABLES = (s.runs, s.tasks, s.scores, s.signals, s.weight_updates, s.run_metrics, s.dead_letters, s.nodes,
                    s.rollout_nodes, s.usage, s.trained_rollouts)
# PostgreSQL: transaction-scoped advisory locks on the rollouts a batch touches, in one order.
_LOCK_ROLLOUTS = sa.text("SELECT pg_advisory_xact_lock(k) FROM (SELECT DISTINCT hashtextextended(x, 0) AS k "
                         "FROM unnest(CAST(:ids AS text[])) AS x ORDER BY k) AS keys")


def _link_live_nodes(insert: Callable[[sa.Table], postgresql.Insert | sqlite.Insert]) -> sa.Insert:
    """Link a live trace node (``rollout_id``, ``node_id``; one row each, executed many) into
    its rollout's graph after the nodes the graph has, unless the rollout is recorded (its
    graph is then the rollout's) or the node is in the graph already. Each row of an
    executemany sees the rows before it, so a batch's nodes are numbered in their order.
    ``insert`` is the dialect's (ON CONFLICT)."""
    rn = s.rollout_nodes.c
    rollout_id, node_id = sa.bindparam("rollout_id", type_=sa.String), sa.bindparam("node_id", type_=sa.String)
    after = (sa.select(sa.func.coalesce(sa.func.max(rn.position) + 1, 0)).where(rn.rollout_id == rollout_id)
             .scalar_subquery())
    unrecorded = sa.not_(sa.exists().where(s.rollouts.c.id == rollout_id))
    link = sa.select(rollout_id, node_id, after).where(unrecorded)  # a WHERE: SQLite then parses ON CONFLICT
    return insert(s.rollout_nodes).from_select(["rollout_id", "node_id", "position"], link).on_conflict_do_nothing()


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


class Store:
    """Reads and writes the trace store. Build with :meth:`open`; :meth:`close` when done."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        self._sqlite_writes = _SqliteWrites(engine) if self.dialect == "sqlite" else None
        # Recording's statements, built once: the engine caches a statement's compiled form by
        # its cache key, which a statement object computes once, so building a statement for
        # every batch (the reward expression above all) and keying it again cost more CPU
        # than running it on a batch of a few dozen rows. IN lists are bound at execution.
        self._insert_new_rows = {table: self._insert(table).on_conflict_do_nothing() for table in _RECORDED_TABLES}
        self._insert_new_rollouts = self._insert(s.rollouts).on_conflict_do_nothing().returning(s.rollouts.c.id)
        self._link_live_nodes = _link_live_nodes(self._insert)
        self._drop_graphs = sa.delete(s.rollout_nodes).where(s.rollout_nodes.c.rollout_id.in_(_ids()))
        self._update_rewards = sa.update(s.rollouts).where(s.rollouts.c.id.in_(_ids())).values(
            reward=reward_expression())
        # Runs this process saw committed: the table keeps them for good (nothing deletes a run),
        # so a batch of theirs needs no insert of its run.
        self._known_runs: set[str] = set()

    @classmethod
    def open(cls, url: str) -> Store:
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

    # --- writing ------------------------------------------------------------------------

    async def record(self, batch: Iterable[events.Event]) -> None:
        """Record a batch of events of any kinds in one transaction. Idempotent.

        Raises :class:`UnrecordableEvent` (before writing anything) for an event that can
        never be recorded; database errors propagate as they are (worth a retry).
        """
        rows = _Rows()
        for e in batch:
            rows.add(e)
        new_runs = [row for run, row in rows.runs.items() if run not in self._known_runs]
        await self._write(lambda conn: self._record(conn, rows, new_runs))
        self._known_runs.update(rows.runs)

    def _record(self, conn: sa.Connection, rows: _Rows, new_runs: list[dict[str, Any]]) -> None:
        """Write ``rows`` (and ``new_runs``, their runs this process has not seen recorded)."""
        touched = rows.touched_rollouts()
        if self.dialect == "postgresql" and touched:
            self._lock_runs(conn, sorted(rows.runs), exclusive=False)
            conn.execute(_LOCK_ROLLOUTS, {"ids": self._texts(touched)})
        self._insert_new(conn, s.runs, new_runs)
        self._insert_new(conn, s.tasks, list(rows.tasks.values()))
        self._insert_new(conn, s.scores, list(rows.scores.values()))
        self._insert_new(conn, s.signals, list(rows.signals.values()))
        # The rollouts recorded now for the first time (a copy of one in the store changes
        # nothing), as stored; under the locks, so no other writer records them meanwhile.
        new_rollouts: set[str] = set()
        if rows.rollouts:
            new_rollouts.update(conn.scalars(self._insert_new_rollouts, self._storable(list(rows.rollouts.values()))))
        for table, values in ((s.weight_updates, rows.weight_updates), (s.run_metrics, rows.run_metrics),
                              (s.dead_letters, rows.dead_letters), (s.usage, rows.usage),
                              (s.trained_rollouts, rows.trained_rollouts)):
            self._insert_new(conn, table, list(values.values()))
        # A rollout's usage with the rollout recorded, never with a later copy of it: the counts
        # are the stored graph's.
        self._insert_new(conn, s.usage, [row for rollout_id, row in rows.rollout_usage.items()
                                          if self._text(rollout_id) in new_rollouts])
        # Sorted, so that concurrent PostgreSQL writers wait on shared nodes in one order.
        self._insert_new(conn, s.nodes, [rows.nodes[k] for k in sorted(rows.nodes)])
        # A rollout recorded now replaces its live graph with exactly the nodes it lists, in
        # its order: live nodes of an attempt inference abandoned (killed mid-rollout, the
        # task redelivered and rolled out again) are dropped. One recorded before keeps the
        # graph of the rollout event that was recorded (the first; a later copy is ignored).
        for ids in _chunks(sorted(new_rollouts)):
            conn.execute(self._drop_graphs, {"ids": ids})
        self._insert_new(conn, s.rollout_nodes, [row for (rollout_id, _), row in rows.rollout_nodes.items()
                                                  if self._text(rollout_id) in new_rollouts])
        # Live nodes, in the order they came; those of a rollout recorded (before or in this
        # batch) add nothing, its graph is the rollout's.
        if rows.trace_links:
            conn.execute(self._link_live_nodes, self._storable(list(rows.trace_links.values())))
        # The rewards this batch can change: a rollout recorded before and not scored now
        # keeps its own, as nothing it is computed from changed.
        rewarded = new_rollouts.union(self._text(row["rollout_id"]) for row in rows.scores.values())
        for ids in _chunks(sorted(rewarded)):
            conn.execute(self._update_rewards, {"ids": ids})

    def _insert_new(self, conn: sa.Connection, table: sa.Table, values: list[dict[str, Any]]) -> None:
        if values:
            conn.execute(self._insert_new_rows[table], self._storable(values))

    def _storable(self, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``values`` as this database can store them (PostgreSQL: no NUL characters)."""
        return [_without_nul(v) for v in values] if self.dialect == "postgresql" else values

    def _text(self, value: str) -> str:
        """A string to look up as it was stored: on PostgreSQL, NUL became U+FFFD (and a NUL in a
        query parameter would be refused by the database)."""
        return _without_nul(value) if self.dialect == "postgresql" else value

    def _texts(self, values: Iterable[str]) -> list[str]:
        return [self._text(v) for v in values]

    async def upsert_runs(self, states: Sequence[events.RunState]) -> None:
        """Record runs with their tenant, kind and scorers (the run-state bucket is the source
        of truth): those of each environment (``env_scorers``) in a run with several, else the
        run's (``scorers``, env ''). A run whose scorers change has the reward of each recorded
        rollout they apply to recomputed; a state without scorers leaves the ones recorded as
        they are (not known is no change)."""
        if not states:
            return
        await self._write(lambda conn: self._upsert_runs(conn, states))
        self._known_runs.update(st.id for st in states)

    def _upsert_runs(self, conn: sa.Connection, states: Sequence[events.RunState]) -> None:
        """Write ``states`` (see :meth:`upsert_runs`)."""
        stmt = self._insert(s.runs)
        stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={
            "tenant": stmt.excluded.tenant, "kind": stmt.excluded.kind,
            "env": sa.func.coalesce(stmt.excluded.env, s.runs.c.env)})  # a state without config keeps it
        rs, r = s.run_scorers.c, s.rollouts.c
        # Each run's scorers as its rows: env -> scorer -> weight; runs whose scorers are not known left out.
        wanted_of = {st.id: wanted for st in states if (wanted := self._run_scorers(st))}
        # A state that names its environments' ids replaces the ones recorded (not known is no change).
        with_ids = list({st.id: st for st in states if st.env_ids}.values())  # a run's last state
        if self.dialect == "postgresql":
            self._lock_runs(conn, sorted(set(wanted_of) | {st.id for st in with_ids}), exclusive=True)
        conn.execute(stmt, [{"id": st.id, "tenant": st.tenant, "kind": st.kind, "created_at": st.created_at,
                             "env": self._text(env) if isinstance(env := st.config.get("env"), str) else None}
                            for st in states])
        if with_ids:
            conn.execute(sa.delete(s.run_envs).where(s.run_envs.c.run.in_(self._texts(st.id for st in with_ids))))
            conn.execute(sa.insert(s.run_envs), [
                {"run": self._text(st.id), "env": self._text(env), "env_id": self._text(env_id)}
                for st in with_ids for env, env_id in st.env_ids.items()])
        for run_id, wanted in wanted_of.items():
            run = self._text(run_id)
            stored: dict[str, dict[str, float]] = {}
            for env, name, weight in conn.execute(sa.select(rs.env, rs.scorer, rs.weight).where(rs.run == run)):
                stored.setdefault(env, {})[name] = weight
            changed = sorted(env for env in stored.keys() | wanted.keys() if stored.get(env) != wanted.get(env))
            if not changed:
                continue
            conn.execute(sa.delete(s.run_scorers).where(rs.run == run, rs.env.in_(changed)))
            conn.execute(sa.insert(s.run_scorers), [{"run": run, "env": env, "scorer": name, "weight": weight}
                                                    for env in changed for name, weight in wanted.get(env, {}).items()])
            # The rollouts whose scorers changed: every one of the run where its '' rows did
            # (a change between one reward and one per environment included), else those of
            # the environments that did.
            of_run = r.run == run if "" in changed else sa.and_(r.run == run, r.env.in_(changed))
            conn.execute(sa.update(s.rollouts).where(of_run).values(reward=reward_expression()))

    def _run_scorers(self, state: events.RunState) -> dict[str, dict[str, float]]:
        """The rows of ``run_scorers`` for ``state``, env -> scorer -> weight, as stored: one set
        per environment of a run with several (``env_scorers``), else the run's ``scorers``
        under ''; empty where they are not known. An environment without scorers has no rows."""
        by_env = state.env_scorers or {"": state.scorers}
        return {self._text(env): {self._text(name): float(weight) for name, weight in scorers.items()}
                for env, scorers in by_env.items() if scorers}

    def _lock_runs(self, conn: sa.Connection, runs: Sequence[str], exclusive: bool) -> None:
        """PostgreSQL: transaction-scoped advisory locks on ``runs`` (keys of their own, apart from
        the rollouts'), in one order; shared by recorders, exclusive for a change of scorers."""
        if not runs:
            return
        lock = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
        conn.execute(
            sa.text(f"SELECT {lock}({_RUN_LOCK_CLASS}, k) FROM (SELECT DISTINCT hashtext(x) AS k "
                    "FROM unnest(CAST(:runs AS text[])) AS x ORDER BY k) AS keys"),
            {"runs": self._texts(runs)},
        )

    # --- reading ------------------------------------------------------------------------

    async def _page(self, listing: str, table: sa.Table, columns: Sequence[sa.Column[Any]],
                    where: list[sa.ColumnElement[bool]], cursor: str | None, limit: int,
                    order: Sequence[sa.Column[Any]] = (), key_types: tuple[Any, ...] = (_Seq,),
                    scope: str | None = None) -> Page:
        """Newest first: descending ``order`` (default ``seq``), keyset on it, so rows recorded
        meanwhile never shift a page. ``key_types`` are the types of the ``order`` columns.
        ``scope`` (the filters' fingerprint) rides in the cursor: a cursor handed out under
        other filters is refused rather than continuing a different listing."""
        _check_limit(limit)
        order = order or (table.c.seq,)
        if cursor is not None:
            key: Sequence[Any] = decode_cursor(listing, cursor, key_types + ((str,) if scope is not None else ()))
            if scope is not None:
                *key, cursor_scope = key
                if cursor_scope != scope:
                    raise InvalidCursor(f"cursor {cursor!r} continues a listing with other filters; pass the same "
                                        "filters as for the first page, or leave out the cursor to start over")
            where = [*where, _before(order, [self._text(k) if isinstance(k, str) else k for k in key])]
        shown = {c.name for c in columns}
        hidden = [c for c in order if c.name not in shown]
        query = (sa.select(*hidden, *columns).where(*where).order_by(*(c.desc() for c in order))
                 .limit(limit + 1))
        async with self.engine.connect() as conn:
            rows = [dict(row) for row in (await conn.execute(query)).mappings()]
        next_cursor = None
        if len(rows) > limit:
            last_key = [rows[limit - 1][c.name] for c in order]
            next_cursor = encode_cursor(listing, *last_key, *([scope] if scope is not None else []))
        items = rows[:limit]
        for row in items:
            for c in hidden:
                del row[c.name]
        return Page(items, next_cursor)

    async def list_tasks(self, run: str | None = None, env: str | None = None, cursor: str | None = None,
                         limit: int = 50, tenant: str | None = None, env_aliases: Sequence[str] = ()) -> Page:
        """Recorded tasks, newest first; ``env`` or any of ``env_aliases`` (its other ids)."""
        c = s.tasks.c
        where = [c.run == self._text(run)] if run is not None else []
        where += [c.env.in_([self._text(e) for e in (env, *env_aliases)])] if env is not None else []
        where += [c.run.in_(sa.select(s.runs.c.id).where(s.runs.c.tenant == self._text(tenant)))] \
            if tenant is not None else []
        return await self._page("tasks", s.tasks, _columns(s.tasks), where, cursor, limit,
                                scope=fingerprint({"run": run, "env": env, "tenant": tenant}))

    async def get_task(self, task_id: str) -> dict[str, Any] | None:
        task_id = self._text(task_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(*_columns(s.tasks)).where(s.tasks.c.id == task_id))).mappings().first()
        return dict(row) if row is not None else None

    async def list_rollouts(self, filters: RolloutFilter | None = None, cursor: str | None = None,
                            limit: int = 50) -> Page:
        filters = filters or RolloutFilter()
        page = await self._page("rollouts", s.rollouts, _columns(s.rollouts, "event"), self._where(filters), cursor,
                                limit, scope=filters.fingerprint())
        failed = await self._failed_scores([row["id"] for row in page.items])
        for row in page.items:
            row["error"] = shown_error(row["status"], row["error"], failed.get(row["id"], []))
        return page

    async def _failed_scores(self, rollout_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """The scores with an error of ``rollout_ids``, by rollout, in scorer order."""
        sc = s.scores.c
        by_rollout: dict[str, list[dict[str, Any]]] = {}
        async with self.engine.connect() as conn:
            for chunk in _chunks(rollout_ids):
                found = await conn.execute(sa.select(sc.rollout_id, sc.scorer, sc.error)
                                           .where(sc.rollout_id.in_(chunk), sc.error.is_not(None))
                                           .order_by(sc.rollout_id, sc.scorer))
                for score in found.mappings():
                    by_rollout.setdefault(score["rollout_id"], []).append(dict(score))
        return by_rollout

    def _where(self, filters: RolloutFilter) -> list[sa.ColumnElement[bool]]:
        run = self._text(filters.run) if filters.run is not None else None
        env = self._text(filters.env) if filters.env is not None else None
        aliases = tuple(self._texts(filters.env_aliases)) if filters.env_aliases is not None else None
        return replace(filters, run=run, env=env, env_aliases=aliases).where()

    async def export_rollouts(self, filters: RolloutFilter | None = None, tokens: bool = False,
                              page_size: int = 100) -> AsyncIterator[dict[str, Any]]:
        """Every rollout that ``filters`` keep, newest first, as one export record each (see
        :func:`export_record`). Read ``page_size`` at a time, each page on a connection that
        is released before its records are handed out: memory stays flat however many rows
        match, and a slow reader holds no connection. Rollouts recorded after the first
        page are not included."""
        _check_limit(page_size)
        c, sc = s.rollouts.c, s.scores.c
        where = self._where(filters or RolloutFilter())
        columns = [c.seq, *_columns(s.rollouts)]
        score_columns = [sc.rollout_id, sc.scorer, sc.value, sc.weight, sc.components, sc.error]
        last_seq: int | None = None
        while True:
            query = (sa.select(*columns).where(*where, *([c.seq < last_seq] if last_seq is not None else []))
                     .order_by(c.seq.desc()).limit(page_size))
            async with self.engine.connect() as conn:
                rows = [dict(row) for row in (await conn.execute(query)).mappings()]
                by_rollout: dict[str, list[dict[str, Any]]] = {}
                if rows:
                    ids = [r["id"] for r in rows]
                    found = await conn.execute(sa.select(*score_columns).where(sc.rollout_id.in_(ids))
                                               .order_by(sc.rollout_id, sc.scorer))
                    for score in found.mappings():
                        by_rollout.setdefault(score["rollout_id"], []).append(
                            {k: v for k, v in score.items() if k != "rollout_id"})
            for row in rows:
                yield export_record(row, by_rollout.get(row["id"], []), tokens)
            if len(rows) < page_size:
                return
            last_seq = rows[-1]["seq"]
            del rows, by_rollout  # not held while the next page is read

    async def has_rollout(self, rollout_id: str) -> bool:
        """Whether the rollout itself (not only live trace nodes of it) is recorded."""
        rollout_id = self._text(rollout_id)
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.rollouts.c.id).where(s.rollouts.c.id == rollout_id)) is not None

    async def get_rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout (without its nodes), its metrics and task data, and its scores."""
        rollout_id = self._text(rollout_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(
                sa.select(*_columns(s.rollouts)).where(s.rollouts.c.id == rollout_id))).mappings().first()
            if row is None:
                return None
            scores = (await conn.execute(
                sa.select(*_columns(s.scores)).where(s.scores.c.rollout_id == rollout_id)
                .order_by(s.scores.c.scorer))).mappings().all()
        out = dict(row)
        event = out.pop("event")
        out["metrics"] = event.get("metrics", {})
        out["task_data"] = event.get("task_data", {})
        out["scores"] = [dict(sc) for sc in scores]
        out["error"] = shown_error(out["status"], out["error"], out["scores"])
        return out

    async def list_runs(self, tenant: str | None = None, cursor: str | None = None, limit: int = 50) -> Page:
        """Runs the store knows, newest first (by creation time, then id)."""
        c = s.runs.c
        where = [c.tenant == self._text(tenant)] if tenant is not None else []
        return await self._page("runs", s.runs, _columns(s.runs), where, cursor, limit,
                                order=(c.created_at, c.id), key_types=(_AwareDatetime, str))

    async def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run with its counts and its latest step (None where no step is recorded yet).

        ``num_scored_rollouts`` counts rollouts with at least one score; ``reward_mean`` is the
        latest step's ``reward_mean`` metric. Counts are queries on the ``run`` indexes.
        """
        run_id = self._text(run_id)
        r, m = s.rollouts.c, s.run_metrics.c
        counts = sa.select(_count(s.tasks, s.tasks.c.run == run_id).label("num_tasks"),
                           _count(s.rollouts, r.run == run_id).label("num_rollouts"),
                           _count(s.rollouts, r.run == run_id, sa.exists().where(s.scores.c.rollout_id == r.id))
                           .label("num_scored_rollouts"))
        latest = sa.select(m.step, m.version, m.metrics).where(m.run == run_id).order_by(m.step.desc()).limit(1)
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(*_columns(s.runs)).where(s.runs.c.id == run_id))).mappings().first()
            if row is None:
                return None
            found = {**row, **(await conn.execute(counts)).mappings().one()}
            step = (await conn.execute(latest)).mappings().first()
        found["latest_step"] = step["step"] if step else None
        found["latest_version"] = step["version"] if step else None
        found["reward_mean"] = step["metrics"].get("reward_mean") if step else None
        return found

    async def latest_steps(self, run_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Each run's latest recorded step (``step``, ``version``, ``reward_mean``), in one query;
        runs without a step are left out."""
        if not run_ids:
            return {}
        m = s.run_metrics.c
        ids = [self._text(run_id) for run_id in run_ids]
        newest = sa.select(m.run, sa.func.max(m.step).label("step")).where(m.run.in_(ids)).group_by(m.run).subquery()
        query = sa.select(m.run, m.step, m.version, m.metrics).join(
            newest, sa.and_(m.run == newest.c.run, m.step == newest.c.step))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return {row["run"]: {"step": row["step"], "version": row["version"],
                             "reward_mean": (row["metrics"] or {}).get("reward_mean")} for row in rows}

    async def run_tenant(self, run_id: str) -> str | None:
        """The tenant the store has for the run (None: no such run recorded)."""
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.runs.c.tenant).where(s.runs.c.id == self._text(run_id)))

    async def rollout_run(self, rollout_id: str) -> str | None:
        """The run of a recorded rollout (None: not recorded)."""
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.rollouts.c.run).where(s.rollouts.c.id == self._text(rollout_id)))

    async def has_run(self, run_id: str) -> bool:
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(s.runs.c.id).where(s.runs.c.id == self._text(run_id))) is not None

    async def list_run_metrics(self, run_id: str, since_step: int | None = None,
                               limit: int = 100) -> list[dict[str, Any]]:
        """The run's steps after ``since_step`` (all without it), ascending, at most ``limit``."""
        _check_limit(limit)
        m = s.run_metrics.c
        where = [m.run == self._text(run_id)] + ([m.step > since_step] if since_step is not None else [])
        query = sa.select(m.step, m.version, m.metrics, m.created_at).where(*where).order_by(m.step).limit(limit)
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]

    async def get_trace(self, rollout_id: str, tokens: bool = False) -> list[dict[str, Any]] | None:
        """The nodes of a rollout's graph in order; None when nothing of it is recorded."""
        rollout_id = self._text(rollout_id)
        n, rn = s.nodes.c, s.rollout_nodes.c
        columns = [n.id, n.parent_id, rn.position, n.message] + ([n.tokens] if tokens else [])
        query = (sa.select(*columns).join_from(s.rollout_nodes, s.nodes, n.id == rn.node_id)
                 .where(rn.rollout_id == rollout_id).order_by(rn.position, n.id))
        async with self.engine.connect() as conn:
            rows = [dict(row) for row in (await conn.execute(query)).mappings()]
            if not rows:
                found = await conn.scalar(sa.select(s.rollouts.c.id).where(s.rollouts.c.id == rollout_id))
                return [] if found is not None else None
        return rows


    def _usage_query(self, keys: dict[str, sa.ColumnElement[Any]], tenant: str | None, run: str | None,
                     since: datetime | None, until: datetime | None) -> sa.Select[Any]:
        """Usage counts summed by ``keys`` (named), of the tenant's and run's counts made at or
        after ``since`` and before ``until``."""
        u = s.usage.c
        where = [(tenant, lambda v: _PAYER == v), (run, lambda v: u.run == v),
                 (since, lambda v: u.created_at >= v), (until, lambda v: u.created_at < v)]
        return (sa.select(*(key.label(name) for name, key in keys.items()), sa.func.count().label("num_counts"),
                          *(sa.func.sum(c).label(c.name) for c in _USAGE_SUMS),
                          sa.func.sum(u.sandbox_s).label("sandbox_s"))
                .select_from(s.usage.outerjoin(s.runs, s.runs.c.id == u.run))
                .where(*(make(self._text(v) if isinstance(v, str) else v) for v, make in where if v is not None))
                .group_by(*keys.values()).order_by(*keys.values()))

    async def _summed_usage(self, query: sa.Select[Any]) -> list[dict[str, Any]]:
        async with self.engine.connect() as conn:
            return [{**row, **{c.name: int(row[c.name] or 0) for c in _USAGE_SUMS},
                     "sandbox_s": float(row["sandbox_s"] or 0.0)}
                    for row in (await conn.execute(query)).mappings()]

    async def usage(self, tenant: str | None = None, run: str | None = None, since: datetime | None = None,
                    until: datetime | None = None) -> list[dict[str, Any]]:
        """What was used, summed by tenant, run and source (``rollout``, ``trainer``, ``sft``,
        ``api``, ``sandbox``), of counts made at or after ``since`` and before ``until``; the tenant is the
        one a count names (an API caller's key), else the run's owner."""
        u = s.usage.c
        keys = {"tenant": _PAYER, "run": u.run, "source": u.source}
        return await self._summed_usage(self._usage_query(keys, tenant, run, since, until))

    async def usage_over_time(self, bucket_s: int, tenant: str | None = None, run: str | None = None,
                              since: datetime | None = None, until: datetime | None = None) -> list[dict[str, Any]]:
        """What was used, summed by time bucket: buckets of ``bucket_s`` whole seconds from the
        Unix epoch (a day's start at 00:00 UTC), each row's ``start`` its bucket's; buckets
        without counts are left out. Filters as :meth:`usage`."""
        if bucket_s < 1:
            raise ValueError(f"bucket_s must be a whole number of seconds >= 1, got {bucket_s}")
        created = s.usage.c.created_at
        if self.dialect == "postgresql":
            seconds: sa.ColumnElement[int] = sa.cast(sa.func.floor(sa.extract("epoch", created)), sa.BigInteger)
        else:  # SQLite keeps the UTC wall time as text; its fraction dropped, strftime would round it up
            seconds = sa.cast(sa.func.strftime("%s", sa.func.substr(created, 1, 19)), sa.BigInteger)
        # A literal, not a parameter: the same expression in SELECT and GROUP BY.
        bucket = seconds // sa.literal_column(str(int(bucket_s)), sa.BigInteger)
        rows = await self._summed_usage(self._usage_query({"bucket": bucket}, tenant, run, since, until))
        for row in rows:
            row["start"] = datetime.fromtimestamp(row.pop("bucket") * bucket_s, UTC)
        return rows

    async def recount_usage(self, run: str) -> dict[str, int]:
        """A training run's tokens counted again from what the store holds, to check the metered
        ones against: each model call of its rollouts (an answer node with sampled tokens: its
        prompt is every token of the branch before them) and the sampled tokens of the rollouts a
        step trained (each node's once, as the trainer trains them). An eval run's rollouts are
        metered as API requests of the run it evaluates, so they are not recounted here."""
        run = self._text(run)
        rn, n, r, t = s.rollout_nodes.c, s.nodes.c, s.rollouts.c, s.trained_rollouts.c
        of_run = (sa.select(rn.rollout_id, n.id, n.parent_id, n.tokens)
                  .join_from(s.rollout_nodes, s.nodes, n.id == rn.node_id)
                  .join(s.rollouts, r.id == rn.rollout_id)
                  .where(r.run == run, r.run.in_(sa.select(s.runs.c.id).where(s.runs.c.kind == "train")))
                  .order_by(rn.rollout_id, rn.position))
        counts = {"num_calls": 0, "prompt_tokens": 0, "sampled_tokens": 0, "trained_tokens": 0}
        async with self.engine.connect() as conn:
            trained = set((await conn.scalars(sa.select(t.rollout_id).where(t.run == run))).all())
            graph: dict[str, tuple[str | None, list[int], list[bool]]] = {}
            current: str | None = None
            for row in await conn.execute(of_run):
                if row.rollout_id != current:
                    _recount_graph(graph, current in trained, counts)
                    graph, current = {}, row.rollout_id
                tokens = row.tokens or {}
                graph[row.id] = (row.parent_id, tokens.get("token_ids", []), tokens.get("loss_mask", []))
            _recount_graph(graph, current in trained, counts)
        return counts

    # --- the environment hub ---------------------------------------------------------------

    async def hub_push(self, package: Package, owner: str, private: bool, pushed_by: str | None,
                       forked_from: str | None = None) -> dict[str, Any]:
        """Store a checked push (:func:`flywheel_gateway.hub.inspect_package`) in one transaction:
        the environment (made on its first push, owned by ``owner``), the version and its files.
        HubRefused when the environment is another tenant's; HubConflict when the version (or one
        of its file names) exists: versions are immutable. Nothing is stored then."""
        h, v, f = s.hub_environments.c, s.hub_versions.c, s.hub_files.c
        now = datetime.now(UTC)
        env_id, version = package.env_id, package.version

        def write(conn: sa.Connection) -> dict[str, Any]:
            found = conn.execute(sa.select(h.owner).where(h.id == env_id)).first()
            if found is None:
                project = project_name(env_id)
                same = conn.execute(sa.select(h.id).where(h.project == project)).scalar()
                if same is not None:
                    raise HubRefused(f"environment {env_id!r}: its package name {project!r} is {same!r}'s already "
                                     "(names are compared with '-', '_' and '.' alike); choose another name")
                conn.execute(sa.insert(s.hub_environments).values(id=env_id, owner=owner, project=project,
                                                                   private=private, forked_from=forked_from,
                                                                   created_at=now))
            elif found.owner != owner:
                raise HubRefused(f"environment {env_id!r} belongs to tenant {found.owner!r}; push it under an "
                                 f"owner of your own (fork it: {owner}/<name>)")
            if conn.execute(sa.select(v.version).where(v.env_id == env_id, v.version == version)).first():
                raise HubConflict(f"{env_id}@{version} exists: a pushed version never changes; push a new version")
            names = [file.filename for file in package.files]
            taken = conn.execute(sa.select(f.filename).where(f.filename.in_(names))).scalars().all()
            if taken:
                raise HubConflict(f"file {taken[0]} exists on the hub; push a new version")
            conn.execute(sa.insert(s.hub_versions).values(
                env_id=env_id, version=version, sha256=package.sha256, summary=package.summary,
                readme=package.readme, pushed_by=pushed_by, created_at=now))
            conn.execute(sa.insert(s.hub_files), [
                {"filename": file.filename, "env_id": env_id, "version": version, "kind": file.kind,
                 "sha256": file.sha256, "size_bytes": len(file.data), "data": file.data} for file in package.files])
            return {"env_id": env_id, "version": version, "sha256": package.sha256, "created_at": now}

        try:
            return await self._write(write)
        except sa.exc.IntegrityError as exc:  # the same version pushed at the same moment
            raise HubConflict(f"{env_id}@{version} exists: a pushed version never changes; push a new "
                              "version") from exc

    async def hub_environment(self, env_id: str) -> dict[str, Any] | None:
        """An environment of the hub with its versions (newest first) and their files (no content);
        None when there is none of that id."""
        h, v, f = s.hub_environments.c, s.hub_versions.c, s.hub_files.c
        async with self.engine.connect() as conn:
            env = (await conn.execute(sa.select(s.hub_environments).where(h.id == env_id))).mappings().first()
            if env is None:
                return None
            versions = [dict(row) for row in (await conn.execute(
                sa.select(v.version, v.sha256, v.summary, v.readme, v.pushed_by, v.created_at)
                .where(v.env_id == env_id))).mappings()]
            files = (await conn.execute(sa.select(f.filename, f.version, f.kind, f.sha256, f.size_bytes)
                                        .where(f.env_id == env_id).order_by(f.filename))).mappings().all()
            forks = (await conn.execute(sa.select(h.id, h.owner, h.private, h.forked_from)
                                        .where(h.forked_from.like(f"{_like_prefix(env_id)}@%", escape="\\"))
                                        .order_by(h.id))).mappings().all()
        for version in versions:
            version["files"] = [{k: row[k] for k in ("filename", "kind", "sha256", "size_bytes")}
                                for row in files if row["version"] == version["version"]]
        versions.sort(key=lambda row: semver_key(row["version"]), reverse=True)
        return {**env, "versions": versions, "forks": [dict(row) for row in forks]}

    async def hub_environments(self, viewer: str | None) -> list[dict[str, Any]]:
        """The hub's environments ``viewer`` may see (the public ones and its own; None: every
        one), by id, each with its newest version."""
        h, v = s.hub_environments.c, s.hub_versions.c
        query = sa.select(s.hub_environments).order_by(h.id)
        if viewer is not None:
            query = query.where(sa.or_(h.private.is_(False), h.owner == viewer))
        async with self.engine.connect() as conn:
            envs = [dict(row) for row in (await conn.execute(query)).mappings()]
            versions = (await conn.execute(sa.select(v.env_id, v.version, v.summary).where(
                v.env_id.in_([env["id"] for env in envs])))).mappings().all()
        newest: dict[str, dict[str, Any]] = {}
        for row in versions:
            key = semver_key(row["version"])
            if row["env_id"] not in newest or key > newest[row["env_id"]]["key"]:
                newest[row["env_id"]] = {"key": key, "version": row["version"], "summary": row["summary"]}
        return [{**env, "latest_version": newest.get(env["id"], {}).get("version"),
                 "summary": newest.get(env["id"], {}).get("summary", "")} for env in envs]

    async def hub_project(self, project: str) -> dict[str, Any] | None:
        """The environment whose package is ``project`` (normalized), with every file of every
        version (no content); None when there is none."""
        h, f = s.hub_environments.c, s.hub_files.c
        async with self.engine.connect() as conn:
            env = (await conn.execute(sa.select(s.hub_environments).where(h.project == project))).mappings().first()
            if env is None:
                return None
            files = (await conn.execute(sa.select(f.filename, f.version, f.kind, f.sha256, f.size_bytes)
                                        .where(f.env_id == env["id"]).order_by(f.filename))).mappings().all()
        return {**env, "files": [dict(row) for row in files]}

    async def hub_file(self, filename: str) -> dict[str, Any] | None:
        """A package file with its content and its environment's owner and visibility; None when
        the hub has no file of that name."""
        h, f = s.hub_environments.c, s.hub_files.c
        query = (sa.select(f.filename, f.env_id, f.version, f.kind, f.sha256, f.size_bytes, f.data, h.owner, h.private)
                 .join_from(s.hub_files, s.hub_environments, h.id == f.env_id).where(f.filename == filename))
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        return dict(row) if row is not None else None

    async def hub_set_private(self, env_id: str, private: bool) -> bool:
        """Make an environment private or public; False when there is none of that id."""
        h = s.hub_environments.c

        def write(conn: sa.Connection) -> bool:
            return conn.execute(sa.update(s.hub_environments).where(h.id == env_id)
                                .values(private=private)).rowcount > 0

        return await self._write(write)

    async def hub_add_eval(self, env_id: str, version: str, figures: dict[str, Any], tenant: str,
                           pushed_by: str | None) -> dict[str, Any]:
        """Attach an eval to a version of an environment: a row of its leaderboard. ``figures``:
        the ``hub_evals`` columns an eval fills (model, reward_mean, reward_stderr, pass_at,
        num_tasks, num_rollouts, prompt_tokens, completion_tokens, summary). LookupError when the
        version is not on the hub."""
        v = s.hub_versions.c
        row = {**figures, "env_id": env_id, "version": version, "tenant": tenant, "pushed_by": pushed_by,
               "created_at": datetime.now(UTC)}

        def write(conn: sa.Connection) -> dict[str, Any]:
            if conn.execute(sa.select(v.version).where(v.env_id == env_id, v.version == version)).first() is None:
                raise LookupError(f"{env_id}@{version} is not on the hub")
            key = conn.execute(sa.insert(s.hub_evals).values(**row)).inserted_primary_key
            assert key is not None  # an INSERT of one row has its primary key
            return {"id": key[0], **row}

        return await self._write(write)

    async def hub_evals(self, env_id: str, version: str | None = None) -> list[dict[str, Any]]:
        """The evals pushed to an environment (one version's, when given): best reward first."""
        e = s.hub_evals.c
        query = sa.select(s.hub_evals).where(e.env_id == env_id)
        if version is not None:
            query = query.where(e.version == version)
        query = query.order_by(e.reward_mean.desc().nulls_last(), e.created_at)
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]

    async def get_signals(self, rollout_id: str) -> list[dict[str, Any]]:
        """The teachers' signals recorded for a rollout, by source."""
        g = s.signals.c
        query = (sa.select(g.source, g.model, g.temperature, g["values"], g.error)
                 .where(g.rollout_id == self._text(rollout_id)).order_by(g.source))
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]


# Who pays for a usage count: the tenant it names (an API caller's key), else the run's owner.
_PAYER = sa.func.coalesce(s.usage.c.tenant, s.runs.c.tenant, "default")
_USAGE_SUMS = (s.usage.c.num_calls, s.usage.c.prompt_tokens, s.usage.c.sampled_tokens, s.usage.c.trained_tokens,
               s.usage.c.sft_tokens)


def _recount_graph(graph: dict[str, tuple[str | None, list[int], list[bool]]], trained: bool,
                   counts: dict[str, int]) -> None:
    """Add one rollout's model calls (and, ``trained``, its trained tokens) to ``counts``:
    ``graph`` maps each of its nodes to (parent, token ids, loss mask)."""
    length: dict[str, int] = {}  # tokens of the branch up to and including a node

    def through(node: str | None) -> int:
        chain: list[str] = []
        while node is not None and node not in length and node in graph:
            chain.append(node)
            node = graph[node][0]
        total = length.get(node, 0) if node is not None else 0
        for each in reversed(chain):
            total += len(graph[each][1])
            length[each] = total
        return total

    for parent, _, loss_mask in graph.values():
        sampled = sum(loss_mask)
        if not sampled:
            continue
        counts["num_calls"] += 1
        counts["prompt_tokens"] += through(parent) + loss_mask.index(True)
        counts["sampled_tokens"] += sampled
        counts["trained_tokens"] += sampled if trained else 0


def export_record(row: dict[str, Any], scores: list[dict[str, Any]], tokens: bool) -> dict[str, Any]:
    """One rollout as an export line: its fields, reward and scores, and the messages of its
    final branch (root to its last node, the branch rewards read; the whole rollout unless
    it branches); with ``tokens``, that branch's concatenated token layer too."""
    event = row["event"]
    nodes = event.get("nodes", [])
    branch = final_branch(nodes, ROWS)
    record = {k: v for k, v in row.items() if k not in ("seq", "event")}
    record["error"] = shown_error(row["status"], row["error"], scores)
    record.update(task_data=event.get("task_data", {}), metrics=event.get("metrics", {}),
                  state=event.get("state", {}), scores=scores,
                  num_nodes=len(nodes), messages=[{"content": "", **n["message"]} for n in branch])
    if tokens:
        joined = join_tokens(branch, ROWS)
        record["tokens"] = {"token_ids": joined.token_ids, "logprobs": joined.logprobs, "loss_mask": joined.loss_mask}
    return record


def reward_expression() -> sa.ColumnElement[float]:
    """A rollout's reward, :func:`flywheel.sdk.scoring.rollout_reward` in SQL (a test holds
    them equal): where its scorers are known (``run_scorers``: its run's rows of its
    environment, or of every environment, env ''; a run has one kind or the other), the sum of
    weight x value over them, NULL while one of them has no score without an error; elsewhere
    the weighted sum of every score, NULL before the first and when one failed. A rollout of a
    run with rows per environment but none of its own takes that rule too, as one of a run
    without rows does. NULL for an errored rollout either way."""
    r, sc, rs = s.rollouts.c, s.scores.c, s.run_scorers.c
    applies = sa.and_(rs.run == r.run, rs.env.in_([r.env, ""]))  # the rows that make this rollout's reward
    known = sa.exists().where(applies)
    scored = sa.exists().where(sc.rollout_id == r.id, sc.scorer == rs.scorer, sc.error.is_(None))
    unmet = sa.exists().where(applies, sa.not_(scored.correlate_except(s.scores)))
    required = (sa.select(sa.func.sum(rs.weight * sc.value))
                .select_from(s.run_scorers.join(s.scores, sa.and_(sc.scorer == rs.scorer, sc.rollout_id == r.id)))
                .where(applies).scalar_subquery())
    every = sa.select(sa.func.sum(sc.value * sc.weight)).where(sc.rollout_id == r.id).scalar_subquery()
    return sa.case((r.status == "error", sa.null()),
                   (known, sa.case((unmet, sa.null()), else_=required)),
                   (_failed_score(r.id), sa.null()),
                   else_=every)


def _count(table: sa.Table, *where: sa.ColumnElement[bool]) -> sa.ScalarSelect[int]:
    return sa.select(sa.func.count()).select_from(table).where(*where).scalar_subquery()


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_PAGE_LIMIT}, got {limit}")


def _columns(table: sa.Table, *leave_out: str) -> list[sa.Column[Any]]:
    return [c for c in table.c if c.name != "seq" and c.name not in leave_out]
