"""Recording: every event on the bus, and every run's state, written into the trace store.

Recording is idempotent and bulk: :meth:`RecordingStore.record` takes a batch of events of any
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

A rollout's reward (:func:`flywheel_gateway.store_reward.reward_expression`) is recomputed in
the same transaction whenever the rollout (its first copy) or one of its scores is recorded,
and for the run's rollouts its scorers apply to when they change
(:meth:`RecordingStore.upsert_runs`), so the order in which they arrive does not matter. A
weight update also gives its run's metrics for its training step (``run_metrics``; the first
update of a step wins).

On PostgreSQL a write transaction first takes transaction-scoped advisory locks on the runs it
touches (shared; a change of a run's scorers takes its lock exclusively) and then on the
rollouts it touches (each in a fixed order), so a score and its rollout recorded at the same
moment by two consumers, or a rollout and its run's scorers, cannot miss each other when the
reward is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from flywheel.contract import events
from flywheel_gateway import schema as s
from flywheel_gateway.store_db import StoreBase, in_chunks
from flywheel_gateway.store_reward import reward_expression

_RUN_LOCK_CLASS = 0x52554E53  # the first key of a run's advisory lock (the two-key space, apart from rollouts')


class UnrecordableEvent(ValueError):
    """An event that can never be recorded as it is (retrying will not help)."""


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


class RecordingStore(StoreBase):
    """Writes events and run states into the store."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
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
        for ids in in_chunks(sorted(new_rollouts)):
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
        for ids in in_chunks(sorted(rewarded)):
            conn.execute(self._update_rewards, {"ids": ids})

    def _insert_new(self, conn: sa.Connection, table: sa.Table, values: list[dict[str, Any]]) -> None:
        if values:
            conn.execute(self._insert_new_rows[table], self._storable(values))

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
