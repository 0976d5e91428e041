"""The trace store and its migrations, on SQLite and on PostgreSQL.

Every test runs on both: a SQLite file in a temporary folder, and a throwaway PostgreSQL
database created for the test (on the server named by the ``postgres_url`` fixture) and
dropped after it. Where no PostgreSQL answers, the PostgreSQL half is skipped with the
reason. Not covered here: the recorder and the API (tests/unit/test_gateway_*.py,
tests/integration/test_recorder*.py).
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from datetime import UTC, datetime, timedelta, timezone

import msgspec
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from flywheel.contract import events
from flywheel_gateway import schema
from flywheel_gateway.migrate import alembic_config, current_revision, migrate, run_exclusively
from flywheel_gateway.store import (
    InvalidCursor,
    RolloutFilter,
    Store,
    UnrecordableEvent,
    encode_cursor,
)

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def task(i: int, run: str = "r1", env: str = "math") -> events.Task:
    return events.Task(id=f"t{i}", run=run, env=env, data={"q": f"{i}+{i}"}, created_at=T0 + timedelta(seconds=i),
                       sampling=events.Sampling(temperature=0.5))


def node(parent: events.Node | None, role: str, content: str, token_ids: list[int] | None = None,
         policy_version: int | None = None) -> events.Node:
    message = events.Message(role=role, content=content)  # type: ignore[arg-type]  # callers pass Message roles
    tokens = None
    if token_ids is not None:
        tokens = events.TokenSpan(token_ids=token_ids, logprobs=[-0.5] * len(token_ids),
                                  loss_mask=[role == "assistant"] * len(token_ids), policy_version=policy_version)
    parent_id = parent.id if parent else None
    return events.Node(id=events.node_id(parent_id, message, tokens), parent_id=parent_id, message=message,
                       tokens=tokens)


def conversation(answer: str) -> list[events.Node]:
    """system -> user -> assistant(answer): the first two are the same for every answer."""
    system = node(None, "system", "be brief", [1, 2])
    user = node(system, "user", "2+2?", [3, 4, 5])
    return [system, user, node(user, "assistant", answer, [6, 7, 8, 9], policy_version=3)]


def rollout(rid: str, *, task_id: str = "t1", group_id: str = "g1", index: int = 0, policy_version: int = 3,
            status: str = "completed", answer: str = "4", run: str = "r1", env: str = "math") -> events.Rollout:
    return events.Rollout(id=rid, run=run, env=env, task_id=task_id, group_id=group_id, index=index,
                          policy_version=policy_version, nodes=conversation(answer),
                          status=status,  # type: ignore[arg-type]  # callers pass a Rollout status
                          metrics={"num_turns": 1.0}, task_data={"q": "2+2"}, created_at=T0)


def score(sid: str, rollout_id: str, value: float, weight: float = 1.0, scorer: str = "exact",
          error: str | None = None) -> events.Score:
    return events.Score(id=sid, run="r1", env="math", rollout_id=rollout_id, group_id="g1", scorer=scorer,
                        value=value, weight=weight, error=error, created_at=T0)


async def count(store: Store, table: sa.Table) -> int:
    async with store.engine.connect() as conn:
        return (await conn.scalar(sa.select(sa.func.count()).select_from(table))) or 0


async def reward(store: Store, rollout_id: str) -> float | None:
    found = await store.get_rollout(rollout_id)
    assert found is not None, rollout_id
    return found["reward"]


# --- migrations ---------------------------------------------------------------------------


async def test_migrate_is_idempotent_and_matches_the_models(database_url: str) -> None:
    assert await current_revision(database_url) is None
    await asyncio.gather(migrate(database_url), migrate(database_url))  # two processes starting at once
    await migrate(database_url)
    assert await current_revision(database_url) == "0011"

    diffs: list[object] = []
    primary_keys: dict[str, list[str]] = {}

    def compare(conn: sa.Connection) -> None:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diffs.extend(compare_metadata(context, schema.metadata))
        # Alembic's comparison leaves primary keys out.
        inspector = sa.inspect(conn)
        primary_keys.update((table, inspector.get_pk_constraint(table)["constrained_columns"])
                            for table in schema.metadata.tables)

    await run_exclusively(database_url, compare)
    assert diffs == [], "the models and the migrations disagree; add a migration (see alembic.ini)"
    assert primary_keys == {name: [c.name for c in table.primary_key.columns]
                            for name, table in schema.metadata.tables.items()}


# Tables today's store writes that came after an older revision: a test that records under an
# older revision has them for the time being (empty, so the reward comes out as it did then).
LATER_TABLES = [schema.run_scorers, schema.run_envs, schema.signals]


async def open_at(database_url: str, revision: str) -> Store:
    """A store on a database at ``revision``, which today's store can write (see LATER_TABLES)."""
    await migrate(database_url, revision)
    s = Store.open(database_url)
    async with s.engine.begin() as conn:
        await conn.run_sync(lambda c: schema.metadata.create_all(c, tables=LATER_TABLES))
    return s


async def migrate_on(s: Store, database_url: str) -> None:
    """Drop what :func:`open_at` added, then migrate to the newest revision."""
    async with s.engine.begin() as conn:
        await conn.run_sync(lambda c: schema.metadata.drop_all(c, tables=LATER_TABLES))
    await migrate(database_url)


async def test_revision_0003_drops_the_reward_of_rollouts_a_scorer_failed_on(database_url: str) -> None:
    s = await open_at(database_url, "0002")
    try:
        # Recorded under 0002, which summed every score, failed ones included.
        await s.record([rollout("ro1"), rollout("ro2"), score("s1", "ro1", 1.0),
                        score("s2", "ro2", 1.0), score("s3", "ro2", 0.0, scorer="judge", error="timed out")])
        async with s.engine.connect() as conn:
            await conn.execute(sa.update(schema.rollouts).values(reward=1.0))
            await conn.commit()
        await migrate_on(s, database_url)
        assert (await reward(s, "ro1"), await reward(s, "ro2")) == (1.0, None)
    finally:
        await s.close()


async def test_revision_0004_drops_phantom_links_of_recorded_rollouts(database_url: str) -> None:
    s = await open_at(database_url, "0003")
    try:
        abandoned, published = attempts()
        await s.record([rollout("ro1"), *live_nodes("ro2", abandoned)])
        # What 0003's recorder left: a live node of an abandoned attempt linked to a recorded rollout.
        await s.record(live_nodes("ro-x", abandoned[2:3]))  # the node row itself
        async with s.engine.begin() as conn:
            await conn.execute(sa.insert(schema.rollout_nodes).values(rollout_id="ro1", node_id=abandoned[2].id,
                                                                      position=2))
        await migrate_on(s, database_url)
        assert [n["id"] for n in await s.get_trace("ro1") or []] == [n.id for n in published]
        # Rollouts not recorded yet keep every live node, of every attempt.
        assert [n["id"] for n in await s.get_trace("ro2") or []] == [n.id for n in abandoned]
    finally:
        await s.close()


# --- recording ----------------------------------------------------------------------------


async def test_tasks_are_recorded_once_with_utc_times(store: Store) -> None:
    batch = [task(i) for i in range(5)]
    await store.record(batch)
    await store.record(batch[2:] + [task(5)])  # redelivery plus one new
    assert await count(store, schema.tasks) == 6
    got = await store.get_task("t3")
    assert got is not None
    assert got["run"] == "r1" and got["data"] == {"q": "3+3"} and got["num_rollouts"] == 1
    assert got["sampling"]["temperature"] == 0.5
    assert got["created_at"] == T0 + timedelta(seconds=3)
    assert got["created_at"].tzinfo is not None and got["created_at"].utcoffset() == timedelta(0)
    assert await store.get_task("nope") is None
    assert await count(store, schema.runs) == 1


async def test_a_sampled_nul_character_is_recorded_on_every_database(store: Store) -> None:
    nul = rollout("r-nul", answer="4\x00")
    await store.record([nul, events.TraceNode(run="r1", rollout_id="r-nul", node=nul.nodes[-1])])
    got = await store.get_rollout("r-nul")
    assert got is not None
    expected = "4\x00" if store.dialect == "sqlite" else "4\ufffd"  # PostgreSQL cannot store NUL
    trace = await store.get_trace("r-nul")
    assert trace is not None and trace[-1]["message"]["content"] == expected


async def test_times_in_other_zones_are_stored_as_utc(store: Store) -> None:
    plus_two = T0.astimezone(timezone(timedelta(hours=2)))
    await store.record([events.Task(id="tz", run="r1", env="e", data={}, created_at=plus_two)])
    got = await store.get_task("tz")
    assert got is not None and got["created_at"] == T0 and got["created_at"].utcoffset() == timedelta(0)


async def test_reward_is_the_weighted_sum_of_scores(store: Store) -> None:
    await store.record([rollout("ro1")])
    assert await reward(store, "ro1") is None  # not scored yet
    await store.record([score("s1", "ro1", 1.0, weight=2.0, scorer="exact")])
    assert await reward(store, "ro1") == pytest.approx(2.0)
    await store.record([score("s2", "ro1", 0.5, weight=-1.0, scorer="length"), score("s1", "ro1", 1.0, weight=2.0)])
    assert await reward(store, "ro1") == pytest.approx(1.5)
    # The same scorer again under a new id (a redelivered rollout scored twice) does not count twice.
    await store.record([score("s3", "ro1", 1.0, weight=2.0, scorer="exact")])
    assert await reward(store, "ro1") == pytest.approx(1.5)
    assert await count(store, schema.scores) == 2


async def test_no_reward_where_a_scorer_failed(store: Store) -> None:
    """The trainer drops a rollout a required scorer failed on; its 0.0 is no reward."""
    await store.record([rollout("ro1"), score("s1", "ro1", 1.0)])
    assert await reward(store, "ro1") == 1.0
    await store.record([score("s2", "ro1", 0.0, scorer="judge", error="judge timed out")])  # arrives later
    assert await reward(store, "ro1") is None
    run = await store.get_run("r1")
    assert run is not None and run["num_scored_rollouts"] == 1
    # ... and when the failed score comes first.
    await store.record([score("s3", "ro2", 0.0, scorer="judge", error="boom")])
    await store.record([rollout("ro2"), score("s4", "ro2", 1.0)])
    assert await reward(store, "ro2") is None


async def test_scores_before_their_rollout_give_the_right_reward(store: Store) -> None:
    await store.record([score("s1", "ro1", 1.0, weight=0.5, scorer="a"), score("s2", "ro1", 1.0, scorer="b")])
    assert await store.get_rollout("ro1") is None
    await store.record([rollout("ro1")])
    assert await reward(store, "ro1") == pytest.approx(1.5)
    # ... and in one batch, in either order.
    await store.record([score("s3", "ro2", 2.0, scorer="a"), rollout("ro2"), rollout("ro3"), score("s4", "ro3", 3.0)])
    assert await reward(store, "ro2") == pytest.approx(2.0)
    assert await reward(store, "ro3") == pytest.approx(3.0)


def run_state(run: str, scorers: dict[str, float],
              env_scorers: dict[str, dict[str, float]] | None = None) -> events.RunState:
    return events.RunState(id=run, config={"run": run, "env": "math"}, scorers=scorers,
                           env_scorers=env_scorers or {}, created_at=T0)


def scored(rid: str, scorer: str, value: float, error: str | None = None, run: str = "r1",
           weight: float = 1.0, env: str = "math") -> events.Score:
    return events.Score(id=f"{rid}.{scorer}", run=run, env=env, rollout_id=rid, group_id="g1", scorer=scorer,
                        value=value, weight=weight, error=error, created_at=T0)


async def test_the_reward_counts_only_the_runs_scorers(store: Store) -> None:
    """A custom scorer outside the run's scorers is recorded and counts for nothing, as in the trainer."""
    await store.upsert_runs([run_state("r1", {"exact": 0.5, "length": 0.0})])
    await store.record([rollout("ro1"), scored("ro1", "exact", 1.0), scored("ro1", "custom", 3.0, weight=2.0)])
    assert await reward(store, "ro1") is None  # "length" has not scored it yet
    await store.record([scored("ro1", "length", 7.0)])
    assert await reward(store, "ro1") == 0.5
    await store.record([scored("ro1", "judge", 0.0, error="judge timed out")])  # not the run's: no matter
    assert await reward(store, "ro1") == 0.5
    # The run's scorers known after its scores: every rollout of the run is recomputed.
    await store.record([rollout("ro2", run="r2"), scored("ro2", "exact", 1.0, run="r2"),
                        scored("ro2", "custom", 1.0, run="r2")])
    assert await reward(store, "ro2") == 2.0  # not known yet: every score
    await store.upsert_runs([run_state("r2", {"exact": 0.25})])
    assert await reward(store, "ro2") == 0.25
    await store.upsert_runs([run_state("r2", {"exact": 0.25, "custom": 1.0})])  # changed: recomputed again
    assert await reward(store, "ro2") == 1.25
    await store.upsert_runs([events.RunState(id="r2", created_at=T0)])  # a state without scorers changes nothing
    assert await reward(store, "ro2") == 1.25


async def test_the_stores_reward_is_the_python_definition(store: Store) -> None:
    """reward_expression (SQL) against flywheel.sdk.scoring.rollout_reward, on every kind of
    rollout: each status, each required scorer present, failed or missing, other scorers, a
    run whose scorers are not known, and a run with several environments, each rewarded with
    its own scorers (flywheel.contract.runs.scorers_of)."""
    from flywheel.contract.runs import scorers_of
    from flywheel.sdk.scoring import rollout_reward

    rng = random.Random(7)
    required = {"a": 0.5, "b": 2.0, "m": 0.0}
    states = {"known": run_state("known", required),
              "envs": run_state("envs", {"a": 0.5, "b": 2.0, "m": 0.0, "custom": 1.0},
                                {"ea": {"a": 0.5, "m": 0.0}, "eb": {"b": 2.0, "custom": 1.0}})}
    await store.upsert_runs(list(states.values()))
    made: dict[str, tuple[str, str, str, list[events.Score]]] = {}  # rollout -> run, env, status, scores
    batch: list[events.Event] = []
    for i in range(180):
        run = ("unknown", "known", "envs")[i % 3]
        env = rng.choice(["ea", "eb"] if run == "envs" else ["ea", "eb", "math"])
        rid = f"ro{i}"
        status = rng.choice(["completed", "completed", "truncated", "error"])
        scores = []
        for name in ("a", "b", "m", "custom"):
            kind = rng.choice(["value", "value", "value", "missing", "error"])
            if kind != "missing":
                scores.append(scored(rid, name, rng.choice([0.0, 0.25, 0.5, 1.0, 3.0]),
                                     error="boom" if kind == "error" else None, run=run, weight=rng.choice([0.5, 1.0]),
                                     env=env))
        batch += [rollout(rid, run=run, status=status, env=env), *scores]
        made[rid] = (run, env, status, scores)

    def want() -> dict[str, float | None]:
        return {rid: rollout_reward(status, scores, scorers_of(states[run], env) if run in states else None)
                for rid, (run, env, status, scores) in made.items()}

    async def got() -> dict[str, float | None]:
        return {r["id"]: r["reward"] for r in (await store.list_rollouts(limit=1000)).items}

    rng.shuffle(batch)  # scores before or after their rollouts
    for i in range(0, len(batch), 37):
        await store.record(batch[i:i + 37])
    assert await got() == pytest.approx(want())
    wanted = want().values()
    assert sum(v is None for v in wanted) > 10 and sum(v is not None for v in wanted) > 10
    # ... and after the runs' scorers change, the rewards recorded are rewritten.
    states = {"known": run_state("known", {"a": 1.0, "custom": 0.5}),
              "envs": run_state("envs", {"a": 0.5, "b": 1.0, "custom": 1.0},
                                {"ea": {"a": 0.5}, "eb": {"b": 1.0, "custom": 1.0}})}
    await store.upsert_runs(list(states.values()))
    assert await got() == pytest.approx(want())


async def run_scorer_rows(store: Store, run: str) -> set[tuple[str, str, float]]:
    rs = schema.run_scorers.c
    async with store.engine.connect() as conn:
        return {(env, name, weight) for env, name, weight in
                await conn.execute(sa.select(rs.env, rs.scorer, rs.weight).where(rs.run == run))}


async def test_a_run_with_several_environments_rewards_each_with_its_own(store: Store) -> None:
    """RunState.env_scorers: a rollout of one environment neither waits for the scorers of
    another nor counts them, and new weights rewrite the rewards recorded."""
    await store.upsert_runs([run_state("r1", {"x": 1.0, "y": 2.0}, {"a": {"x": 1.0}, "b": {"y": 2.0}})])
    assert await run_scorer_rows(store, "r1") == {("a", "x", 1.0), ("b", "y", 2.0)}  # and none for ''
    await store.record([rollout("ra", env="a"), scored("ra", "x", 0.5, env="a"),
                        rollout("rb", env="b"), scored("rb", "x", 0.5, env="b")])
    assert await reward(store, "ra") == 0.5  # not waiting for y
    assert await reward(store, "rb") is None  # b's reward is y's
    await store.record([scored("rb", "y", 0.25, env="b"), scored("ra", "y", 3.0, env="a")])
    assert (await reward(store, "ra"), await reward(store, "rb")) == (0.5, 0.5)  # a's y counts for nothing
    # New weights in a new state: the rewards recorded are rewritten.
    await store.upsert_runs([run_state("r1", {"x": 2.0, "y": 4.0}, {"a": {"x": 2.0, "y": 1.0}, "b": {"y": 4.0}})])
    assert (await reward(store, "ra"), await reward(store, "rb")) == (4.0, 1.0)
    # Only the rewards of the environments whose scorers changed.
    async with store.engine.begin() as conn:
        await conn.execute(sa.update(schema.rollouts).values(reward=-1.0))
    await store.upsert_runs([run_state("r1", {"x": 2.0, "y": 2.0}, {"a": {"x": 2.0, "y": 1.0}, "b": {"y": 2.0}})])
    assert (await reward(store, "ra"), await reward(store, "rb")) == (-1.0, 0.5)
    # A rollout of an environment the state does not name: every score, at its own weight.
    await store.record([rollout("rc", env="c"), scored("rc", "x", 1.0, env="c", weight=3.0)])
    assert await reward(store, "rc") == 3.0
    # One reward for the whole run again: every rollout takes it, the per-environment rows go.
    await store.upsert_runs([run_state("r1", {"x": 1.0})])
    assert await run_scorer_rows(store, "r1") == {("", "x", 1.0)}
    assert [await reward(store, rid) for rid in ("ra", "rb", "rc")] == [0.5, 0.5, 1.0]
    # ... and one per environment again: the '' rows go.
    await store.upsert_runs([run_state("r1", {"x": 1.0, "y": 2.0}, {"a": {"x": 1.0}, "b": {"y": 2.0}})])
    assert await run_scorer_rows(store, "r1") == {("a", "x", 1.0), ("b", "y", 2.0)}
    assert [await reward(store, rid) for rid in ("ra", "rb", "rc")] == [0.5, 0.5, 3.0]
    # Another run's rollouts of an environment of the same name are not this run's.
    await store.record([rollout("r2a", run="r2", env="a"), scored("r2a", "y", 1.0, run="r2", env="a")])
    assert await reward(store, "r2a") == 1.0


async def test_revision_0007_gives_the_scorers_recorded_before_every_environment(database_url: str) -> None:
    """Upgraded, a run's rows of before are its rows of every environment (env ''); downgraded,
    the rows of single environments go (the old key holds a scorer once a run)."""
    s = await open_at(database_url, "0007")
    try:
        await s.upsert_runs([run_state("r1", {"exact": 0.5}),
                             run_state("r2", {"x": 1.0, "y": 1.0}, {"a": {"x": 1.0}, "b": {"y": 1.0}})])
        await s.record([rollout("ro1"), scored("ro1", "exact", 1.0), scored("ro1", "custom", 3.0)])
        assert await reward(s, "ro1") == 0.5
    finally:
        await s.close()
    for table in (schema.run_envs, schema.signals):  # open_at's, of later revisions
        await run_exclusively(database_url, table.drop)
    await run_exclusively(database_url, lambda conn: command.downgrade(alembic_config(conn), "0006"))
    assert await current_revision(database_url) == "0006"
    s = Store.open(database_url)
    try:
        async with s.engine.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT run, scorer, weight FROM run_scorers"))).all()
        assert [tuple(row) for row in rows] == [("r1", "exact", 0.5)]
    finally:
        await s.close()
    await migrate(database_url)
    s = Store.open(database_url)
    try:
        assert await run_scorer_rows(s, "r1") == {("", "exact", 0.5)}
        assert await run_scorer_rows(s, "r2") == set()  # until the recorder mirrors its state again
        assert await reward(s, "ro1") == 0.5
        await s.record([rollout("ro2", env="other"), scored("ro2", "exact", 1.0, env="other"),
                        scored("ro2", "custom", 3.0, env="other")])
        assert await reward(s, "ro2") == 0.5  # the run's reward, whatever the environment
    finally:
        await s.close()


async def test_revision_0005_clears_the_reward_of_errored_rollouts(database_url: str) -> None:
    s = await open_at(database_url, "0004")
    try:
        await s.record([rollout("ro1"), rollout("ro2", status="error"), score("s1", "ro1", 1.0),
                        score("s2", "ro2", 1.0)])
        async with s.engine.connect() as conn:  # 0004 gave an errored rollout the sum of its scores
            await conn.execute(sa.update(schema.rollouts).values(reward=1.0))
            await conn.commit()
        await migrate_on(s, database_url)
        assert (await reward(s, "ro1"), await reward(s, "ro2")) == (1.0, None)
    finally:
        await s.close()


async def test_concurrent_score_and_rollout_writers_agree(store: Store) -> None:
    """Two consumers recording a rollout and its score at the same moment (a race on PostgreSQL)."""
    for i in range(20):
        await asyncio.gather(store.record([rollout(f"ro{i}")]), store.record([score(f"s{i}", f"ro{i}", 1.0)]))
    page = await store.list_rollouts(limit=100)
    assert [r["reward"] for r in page.items] == [1.0] * 20


async def test_rollout_detail_has_its_scores_metrics_and_token_count(store: Store) -> None:
    await store.record([rollout("ro1"), score("s1", "ro1", 1.0, scorer="b"), score("s2", "ro1", 0.0, scorer="a")])
    got = await store.get_rollout("ro1")
    assert got is not None
    assert got["num_tokens"] == 2 + 3 + 4
    assert got["metrics"] == {"num_turns": 1.0} and got["task_data"] == {"q": "2+2"}
    assert [sc["scorer"] for sc in got["scores"]] == ["a", "b"]
    assert got["index"] == 0 and got["policy_version"] == 3 and got["status"] == "completed"


async def test_nodes_are_shared_across_rollouts(store: Store) -> None:
    await store.record([rollout("ro1", answer="4"), rollout("ro2", answer="5")])
    await store.record([rollout("ro3", answer="4")])  # same graph as ro1
    assert await count(store, schema.nodes) == 4  # system, user, "4", "5"
    assert await count(store, schema.rollout_nodes) == 9
    trace = await store.get_trace("ro2", tokens=True)
    assert trace is not None
    assert [n["message"]["content"] for n in trace] == ["be brief", "2+2?", "5"]
    assert [n["position"] for n in trace] == [0, 1, 2]
    assert trace[0]["parent_id"] is None and trace[2]["parent_id"] == trace[1]["id"]
    assert trace[2]["tokens"] == {"token_ids": [6, 7, 8, 9], "logprobs": [-0.5] * 4,
                                  "loss_mask": [True] * 4, "policy_version": 3}
    without_tokens = await store.get_trace("ro2")
    assert without_tokens is not None and "tokens" not in without_tokens[0]
    assert await store.get_trace("unknown") is None


async def test_a_teachers_signals_are_recorded_once_per_rollout_and_source(store: Store) -> None:
    r = rollout("ro1", answer="4")
    answer = r.nodes[-1].id

    def signal(source: str, values: list[float], error: str | None = None) -> events.Signal:
        return events.Signal(id=f"ro1.{source}", run=r.run, env=r.env, rollout_id="ro1", group_id=r.group_id,
                             source=source, values={} if error else {answer: values}, temperature=0.7,
                             model="teacher-model", error=error, top_ids={answer: [[1, 2]] * len(values)},
                             top_logprobs={answer: [[-0.1, -2.5]] * len(values)}, created_at=T0)

    await store.record([signal("expert", [-0.5, -0.25, -1.0, -2.0]), r])
    await store.record([signal("expert", [0.0] * 4), signal("bad", [], error="too long")])  # a redelivery: kept
    assert await store.get_signals("ro1") == [
        {"source": "bad", "model": "teacher-model", "temperature": 0.7, "values": {}, "error": "too long"},
        {"source": "expert", "model": "teacher-model", "temperature": 0.7,
         "values": {answer: [-0.5, -0.25, -1.0, -2.0]}, "error": None}]
    assert await store.get_signals("unknown") == []


async def test_live_trace_nodes_then_the_rollout(store: Store) -> None:
    nodes = conversation("4")
    live = [events.TraceNode(run="r1", rollout_id="ro1", node=n) for n in nodes[:2]]
    await store.record(live[:1])
    await store.record(live)  # redelivery of the first, plus the second
    trace = await store.get_trace("ro1")
    assert trace is not None and [n["position"] for n in trace] == [0, 1]
    assert [n["id"] for n in trace] == [n.id for n in nodes[:2]]
    await store.record([rollout("ro1")])
    trace = await store.get_trace("ro1")
    assert trace is not None and [n["id"] for n in trace] == [n.id for n in nodes]
    assert [n["position"] for n in trace] == [0, 1, 2]
    await store.record([events.TraceNode(run="r1", rollout_id="ro1", node=nodes[2])])  # late live copy: no change
    assert await count(store, schema.rollout_nodes) == 3


def attempts() -> tuple[list[events.Node], list[events.Node]]:
    """Two attempts at one rollout: inference was killed during the first (it had published a
    tool call and its result live), and the redelivered task's second attempt answered "4"."""
    system, user, answer = conversation("4")
    call = node(user, "assistant", "let me check", [10, 11], policy_version=3)
    return [system, user, call, node(call, "tool", "4", [12])], [system, user, answer]


def live_nodes(rollout_id: str, nodes: list[events.Node]) -> list[events.TraceNode]:
    return [events.TraceNode(run="r1", rollout_id=rollout_id, node=n) for n in nodes]


@pytest.mark.parametrize("order", ["live nodes first", "rollout first", "one batch"])
async def test_a_recorded_rollout_is_exactly_the_nodes_it_lists(store: Store, order: str) -> None:
    abandoned, published = attempts()
    live, done = live_nodes("ro1", abandoned + published), rollout("ro1")  # rollout("ro1") lists `published`
    if order == "live nodes first":
        await store.record(live[:4])
        before = await store.get_trace("ro1")  # while it runs, the abandoned attempt shows
        assert before is not None and [n["id"] for n in before] == [n.id for n in abandoned]
        await store.record(live[4:])
        await store.record([done])
    elif order == "rollout first":  # the TRACES consumer lags behind the ROLLOUTS one
        await store.record([done])
        await store.record(live)
    else:
        await store.record([live[0], done, *live[1:]])
    expected = [(n.id, position) for position, n in enumerate(published)]
    trace = await store.get_trace("ro1")
    assert trace is not None and [(n["id"], n["position"]) for n in trace] == expected
    # Redelivered, or a second copy of the rollout with another graph (past the bus's
    # duplicate window): the graph of the recorded rollout stays.
    other = msgspec.structs.replace(rollout("ro1", answer="5"), nodes=conversation("5"))
    await store.record([*live, done])
    await store.record([other, *live_nodes("ro1", other.nodes)])
    trace = await store.get_trace("ro1")
    assert trace is not None and [(n["id"], n["position"]) for n in trace] == expected
    assert await count(store, schema.rollout_nodes) == 3


async def test_live_nodes_of_rollouts_in_one_batch_are_numbered_each_in_its_order(store: Store) -> None:
    """Live nodes of two rollouts interleaved in a batch, with a redelivered one: each rollout's
    graph numbers them in the order they came, after the nodes it had (what the store numbers in SQL)."""
    a, b = conversation("4"), conversation("5")
    await store.record(live_nodes("ro-a", a[:1]))
    await store.record([*live_nodes("ro-b", b[:1]), *live_nodes("ro-a", a), *live_nodes("ro-b", b[1:])])
    for rollout_id, nodes in (("ro-a", a), ("ro-b", b)):
        trace = await store.get_trace(rollout_id)
        assert trace is not None
        assert [(n["id"], n["position"]) for n in trace] == [(n.id, position) for position, n in enumerate(nodes)]


async def test_an_in_memory_database_is_written_on_its_own_connection() -> None:
    """An in-memory SQLite database is its engine's one connection: writes stay on it, not on
    the blocking engine a file's writes go through (which would open another, empty database)."""
    s = Store.open("sqlite+aiosqlite:///:memory:")
    try:
        async with s.engine.begin() as conn:
            await conn.run_sync(schema.metadata.create_all)
        await s.record([task(1), rollout("ro1"), score("s1", "ro1", 0.5)])
        got = await s.get_rollout("ro1")
        assert got is not None and got["reward"] == 0.5
    finally:
        await s.close()


async def test_weight_updates_and_dead_letters(store: Store) -> None:
    update = events.WeightUpdate(id="w1", run="r1", version=2, uri="nats-os://flywheel-weights/r1/2", sha256="ab" * 32,
                                 size_bytes=5_000_000_000, format="lora", trainer_step=7)
    letter = events.DeadLetter(id="TASKS.9.recorder-tasks", stream="TASKS", original_subject="tasks.x.y",
                               consumer="recorder-tasks", num_delivered=1, reason="payload does not decode",
                               payload=b"\x00\xffgarbage", headers={"Nats-Msg-Id": "m"})
    await store.record([update, letter])
    await store.record([update, letter])
    async with store.engine.connect() as conn:
        weights = (await conn.execute(sa.select(schema.weight_updates))).mappings().all()
        letters = (await conn.execute(sa.select(schema.dead_letters))).mappings().all()
    assert len(weights) == 1 and weights[0]["size_bytes"] == 5_000_000_000 and weights[0]["format"] == "lora"
    assert len(letters) == 1 and letters[0]["payload"] == b"\x00\xffgarbage"
    assert letters[0]["headers"] == {"Nats-Msg-Id": "m"}


async def test_runs_get_their_tenant_from_run_state(store: Store) -> None:
    await store.record([task(1, run="r1")])  # recorded first: default tenant
    await store.upsert_runs([events.RunState(id="r1", tenant="acme", kind="eval"), events.RunState(id="r2")])
    await store.record([task(2, run="r1"), task(3, run="r2")])  # does not overwrite
    async with store.engine.connect() as conn:
        runs = {r.id: (r.tenant, r.kind) for r in await conn.execute(sa.select(schema.runs))}
    assert runs == {"r1": ("acme", "eval"), "r2": ("default", "train")}


async def test_events_that_can_never_be_recorded_are_refused(store: Store) -> None:
    with pytest.raises(UnrecordableEvent, match="does not record RunState"):
        await store.record([task(1), events.RunState(id="r1")])  # type: ignore[list-item]  # not an Event on purpose
    naive = events.Task(id="naive", run="r1", env="e", data={}, created_at=datetime(2026, 1, 1))
    with pytest.raises(UnrecordableEvent, match="'naive': created_at 2026-01-01T00:00:00 has no time zone"):
        await store.record([task(2), naive])
    assert await count(store, schema.tasks) == 0  # nothing of a refused batch is written


# --- reading ------------------------------------------------------------------------------


async def test_task_pages_cover_everything_once_newest_first(store: Store) -> None:
    await store.record([task(i, env="math" if i % 2 else "code") for i in range(25)])
    seen: list[str] = []
    cursor = None
    for _ in range(10):
        page = await store.list_tasks(cursor=cursor, limit=10)
        seen += [t["id"] for t in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
        # Rows recorded between pages do not shift the next page.
        await store.record([task(100 + len(seen), env="later")])
    assert seen[:10] == [f"t{i}" for i in range(24, 14, -1)]
    assert len(seen) == 25 and len(set(seen)) == 25
    math = await store.list_tasks(run="r1", env="math", limit=1000)
    assert {t["id"] for t in math.items} == {f"t{i}" for i in range(1, 25, 2)} and math.next_cursor is None
    assert (await store.list_tasks(run="other")).items == []


async def test_bad_cursors_and_limits_are_refused(store: Store) -> None:
    await store.record([task(1), task(2), rollout("ro1"), rollout("ro2")])
    tasks_cursor = (await store.list_tasks(limit=1)).next_cursor
    assert tasks_cursor is not None
    with pytest.raises(InvalidCursor, match="tasks listing"):
        await store.list_rollouts(cursor=tasks_cursor)
    # A cursor of one run's tasks does not continue another's (an empty page would say "no more").
    await store.record([task(3, run="r2"), task(4, run="r2")])
    run_cursor = (await store.list_tasks(run="r2", limit=1)).next_cursor
    for run, env in (("r1", None), (None, None), ("r2", "code")):
        with pytest.raises(InvalidCursor, match="other filters"):
            await store.list_tasks(run=run, env=env, cursor=run_cursor)
    assert [t["id"] for t in (await store.list_tasks(run="r2", cursor=run_cursor)).items] == [task(3, run="r2").id]
    for garbage in ("!!", "bm90IGpzb24", ""):
        with pytest.raises(InvalidCursor, match="not a cursor"):
            await store.list_tasks(cursor=garbage)
    with pytest.raises(ValueError, match="limit"):
        await store.list_tasks(limit=0)
    # Well-formed, but holding keys no column takes: refused, never sent to the database.
    for listing, key in (("tasks", [2**63]), ("runs", ["2026-01-01T00:00:00", "r1"]),
                         ("runs", ["0001-01-01T00:00:00+01:00", "r1"])):
        with pytest.raises(InvalidCursor, match="not a cursor"):
            await (store.list_tasks if listing == "tasks" else store.list_runs)(cursor=encode_cursor(listing, *key))


async def test_lookups_take_any_text(store: Store) -> None:
    """A NUL (which PostgreSQL refuses in a query, and stores as U+FFFD) finds what was
    recorded under it, on every database, instead of failing."""
    odd = "t\x00odd"
    await store.record([events.Task(id=odd, run="r\x00", env="e\x00", data={}, created_at=T0)])
    found = await store.get_task(odd)
    assert found is not None and found["run"] in ("r\x00", "r\ufffd")
    assert [t["run"] for t in (await store.list_tasks(run="r\x00", env="e\x00")).items] == [found["run"]]
    assert await store.get_task("\x00") is None and await store.get_rollout("\x00") is None
    assert await store.get_trace("\x00") is None and not await store.has_rollout("\x00")
    assert await store.get_run("\x00") is None and not await store.has_run("\x00")
    assert (await store.list_rollouts(RolloutFilter(run="\x00", env="\x00"))).items == []
    assert [r async for r in store.export_rollouts(RolloutFilter(run="\x00"))] == []
    assert (await store.list_runs(tenant="\x00")).items == [] and await store.list_run_metrics("\x00") == []


async def test_rollout_filters(store: Store) -> None:
    await store.record([
        rollout("low", policy_version=1), rollout("mid", policy_version=2), rollout("high", policy_version=3),
        rollout("broken", policy_version=3, status="error"),
        score("s1", "low", 0.1), score("s2", "mid", 0.5), score("s3", "high", 0.9),
    ])

    async def ids(**filters: object) -> set[str]:
        page = await store.list_rollouts(
            RolloutFilter(**filters), limit=100)  # type: ignore[arg-type]  # callers pass its fields' types
        return {r["id"] for r in page.items}

    assert await ids() == {"low", "mid", "high", "broken"}
    assert await ids(min_reward=0.5) == {"mid", "high"}
    assert await ids(min_reward=0.2, max_reward=0.6) == {"mid"}
    assert await ids(policy_version=3) == {"high", "broken"}
    assert await ids(min_policy_version=2, max_policy_version=2) == {"mid"}
    assert await ids(status="error") == {"broken"}
    assert await ids(run="r1", env="math", status="completed", max_reward=0.2) == {"low"}
    assert await ids(run="r2") == set()
    first = await store.list_rollouts(limit=3)
    rest = await store.list_rollouts(cursor=first.next_cursor, limit=3)
    assert [r["id"] for r in first.items + rest.items] == ["broken", "high", "mid", "low"]
    assert rest.next_cursor is None and "event" not in first.items[0]


async def test_rollout_error_and_time_filters(store: Store) -> None:
    def at(rid: str, minutes: int, **kw: object) -> events.Rollout:
        r = rollout(rid, **kw)  # type: ignore[arg-type]  # the calls below pass rollout()'s keywords
        return msgspec.structs.replace(r, created_at=T0 + timedelta(minutes=minutes))

    await store.record([
        at("ok", 0), at("broken", 1, status="error"), at("scorer-failed", 2),
        msgspec.structs.replace(rollout("message", status="truncated"), error="sandbox lost", created_at=T0),
        score("s1", "ok", 1.0), score("s2", "scorer-failed", 0.0, error="judge timed out"),
    ])

    async def ids(**filters: object) -> set[str]:
        page = await store.list_rollouts(
            RolloutFilter(**filters), limit=100)  # type: ignore[arg-type]  # callers pass its fields' types
        return {r["id"] for r in page.items}

    assert await ids(error=True) == {"broken", "scorer-failed", "message"}
    assert await ids(error=False) == {"ok"}
    # A flag of the reward-hacking watch marks a rollout; it is no score of the reward.
    await store.record([score("w1", "ok", 1.0, weight=0.0, scorer=events.WATCH_SCORER)])
    assert await ids(flagged=True) == {"ok"}
    assert await ids(flagged=False) == {"broken", "scorer-failed", "message"}
    assert await ids(flagged=True, error=False) == {"ok"}
    assert await ids(error=True, status="truncated") == {"message"}
    assert await ids(created_after=T0 + timedelta(minutes=1)) == {"broken", "scorer-failed"}
    assert await ids(created_before=T0 + timedelta(minutes=1)) == {"ok", "message"}
    assert await ids(created_after=T0 + timedelta(minutes=1), created_before=T0 + timedelta(minutes=2)) == {"broken"}
    # Another zone means the same instant.
    east = timezone(timedelta(hours=2))
    assert await ids(created_after=datetime(2026, 11, 1, 14, 2, tzinfo=east)) == {"scorer-failed"}


async def test_a_cursor_continues_only_its_own_filters(store: Store) -> None:
    await store.record([rollout(f"ro{i:02}", policy_version=i % 2) for i in range(10)])
    odd = RolloutFilter(policy_version=1)
    seen: list[str] = []
    page = await store.list_rollouts(odd, limit=2)
    while True:
        seen += [r["id"] for r in page.items]
        # A matching rollout and a scored one recorded between pages shift nothing.
        await store.record([rollout(f"new{len(seen)}", policy_version=1)])
        if page.next_cursor is None:
            break
        page = await store.list_rollouts(odd, cursor=page.next_cursor, limit=2)
    assert seen == ["ro09", "ro07", "ro05", "ro03", "ro01"]
    cursor = (await store.list_rollouts(odd, limit=2)).next_cursor
    # The same filters spelled otherwise (a time in another zone) are the same listing.
    after = RolloutFilter(created_after=T0)
    cursor_after = (await store.list_rollouts(after, limit=2)).next_cursor
    same = RolloutFilter(created_after=T0.astimezone(timezone(timedelta(hours=-5))))
    assert len((await store.list_rollouts(same, cursor=cursor_after, limit=2)).items) == 2
    with pytest.raises(InvalidCursor, match="other filters"):
        await store.list_rollouts(RolloutFilter(policy_version=0), cursor=cursor)
    with pytest.raises(InvalidCursor, match="other filters"):
        await store.list_rollouts(cursor=cursor)


async def test_export_has_messages_scores_and_tokens(store: Store) -> None:
    with_state = msgspec.structs.replace(rollout("ro1", answer="4"), state={"board": ["crane"]})
    await store.record([with_state, rollout("ro2", answer="5", status="error"),
                        score("s1", "ro1", 1.0), score("s2", "ro1", 0.5, weight=2.0, scorer="length")])
    records = [r async for r in store.export_rollouts(RolloutFilter(error=False), tokens=True)]
    assert [r["id"] for r in records] == ["ro1"]
    (record,) = records
    assert record["reward"] == 2.0 and record["num_nodes"] == 3 and record["created_at"] == T0
    assert record["state"] == {"board": ["crane"]}
    assert [(sc["scorer"], sc["value"], sc["weight"]) for sc in record["scores"]] == [("exact", 1.0, 1.0),
                                                                                     ("length", 0.5, 2.0)]
    assert [m["content"] for m in record["messages"]] == ["be brief", "2+2?", "4"]
    # A message without text (only tool calls) still has its content, empty.
    call = events.Message(role="assistant", tool_calls=[events.ToolCall(id="c1", name="add", arguments='{"a": 2}')])
    user = rollout("x").nodes[1]
    tool_use = events.Node(id=events.node_id(user.id, call, None), parent_id=user.id, message=call)
    await store.record([msgspec.structs.replace(rollout("ro3"), nodes=[*rollout("x").nodes[:2], tool_use])])
    (tool_record,) = [r async for r in store.export_rollouts() if r["id"] == "ro3"]
    assert tool_record["messages"][-1] == {"role": "assistant", "content": "",
                                           "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 2}'}]}
    assert record["tokens"]["token_ids"] == list(range(1, 10))
    assert record["tokens"]["loss_mask"] == [False] * 5 + [True] * 4
    everything = [r async for r in store.export_rollouts(page_size=1)]
    assert [r["id"] for r in everything] == ["ro3", "ro2", "ro1"] and "tokens" not in everything[0]


async def test_export_memory_does_not_grow_with_the_number_of_rollouts(store: Store) -> None:
    """Peak memory while exporting 10x more rollouts stays about the same (pages of 50)."""
    async def peak_bytes(run: str, num: int) -> int:
        await store.record([rollout(f"{run}-{i}", run=run, answer="x" * 2000) for i in range(num)])
        tracemalloc.start()
        try:
            num_seen = 0
            async for _ in store.export_rollouts(RolloutFilter(run=run), tokens=True, page_size=50):
                num_seen += 1
            assert num_seen == num
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = await peak_bytes("small", 100), await peak_bytes("large", 1000)
    assert large < 1.5 * small, (small, large)


# --- runs and their metrics ---------------------------------------------------------------


def weight_update(run: str, step: int, metrics: dict[str, float], wid: str | None = None) -> events.WeightUpdate:
    return events.WeightUpdate(id=wid or f"{run}.w{step}", run=run, version=step + 1, uri=f"file:///w/{step}",
                               sha256="00" * 32, size_bytes=1, trainer_step=step, metrics=metrics,
                               created_at=T0 + timedelta(minutes=step))


async def test_weight_updates_record_one_metrics_row_per_step(store: Store) -> None:
    steps = [weight_update("r1", i, {"loss": 1.0 / (i + 1), "reward_mean": i / 10}) for i in range(4)]
    await store.record(steps[:2])
    await store.record(steps + [weight_update("r2", 0, {"loss": 9.0})])  # a redelivery, two new steps, another run
    # The same step again under another id (a trainer retrying it): the first one stays.
    await store.record([weight_update("r1", 2, {"loss": 0.0}, wid="retry")])
    assert await count(store, schema.run_metrics) == 5
    got = await store.list_run_metrics("r1")
    assert [(m["step"], m["version"]) for m in got] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert got[2]["metrics"] == {"loss": pytest.approx(1 / 3), "reward_mean": pytest.approx(0.2)}
    assert got[3]["created_at"] == T0 + timedelta(minutes=3)
    assert [m["step"] for m in await store.list_run_metrics("r1", since_step=1)] == [2, 3]
    assert [m["step"] for m in await store.list_run_metrics("r1", since_step=-5, limit=2)] == [0, 1]
    assert await store.list_run_metrics("r1", since_step=3) == []
    assert await store.list_run_metrics("nope") == []
    with pytest.raises(ValueError, match="limit"):
        await store.list_run_metrics("r1", limit=0)
    latest = await store.latest_steps(["r1", "r2", "nope"])  # the runs page's one query
    assert latest == {"r1": {"step": 3, "version": 4, "reward_mean": pytest.approx(0.3)},
                      "r2": {"step": 0, "version": 1, "reward_mean": None}}
    assert await store.latest_steps([]) == {}


async def test_run_detail_has_counts_and_the_latest_step(store: Store) -> None:
    await store.record([task(1), task(2), task(3, run="r2"), rollout("ro1"), rollout("ro2"), rollout("ro3"),
                        rollout("other", run="r2"), score("s1", "ro1", 1.0), score("s2", "ro2", 0.0),
                        score("s3", "ro2", 1.0, scorer="length")])
    got = await store.get_run("r1")
    assert got is not None
    assert (got["num_tasks"], got["num_rollouts"], got["num_scored_rollouts"]) == (2, 3, 2)
    assert (got["latest_step"], got["latest_version"], got["reward_mean"]) == (None, None, None)
    assert (got["tenant"], got["kind"]) == ("default", "train")
    await store.record([weight_update("r1", 1, {"reward_mean": 0.25}), weight_update("r1", 0, {"reward_mean": 0.5})])
    got = await store.get_run("r1")
    assert got is not None and (got["latest_step"], got["latest_version"], got["reward_mean"]) == (1, 2, 0.25)
    await store.record([weight_update("r1", 2, {"loss": 1.0})])  # a step without reward_mean
    got = await store.get_run("r1")
    assert got is not None and (got["latest_step"], got["reward_mean"]) == (2, None)
    assert await store.get_run("nope") is None
    assert await store.has_run("r2") and not await store.has_run("nope")


async def test_run_pages_cover_every_run_once_newest_first(store: Store) -> None:
    # Three runs share a creation time: the id orders them, and a page may end among them.
    times = {"a": T0, "b": T0 + timedelta(hours=1), "c": T0 + timedelta(hours=1), "d": T0 + timedelta(hours=1),
             "e": T0 + timedelta(hours=2)}
    await store.upsert_runs([events.RunState(id=run, tenant="acme" if run in "bd" else "default", created_at=at)
                             for run, at in times.items()])
    seen: list[str] = []
    cursor = None
    while True:
        page = await store.list_runs(cursor=cursor, limit=2)
        seen += [r["id"] for r in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == ["e", "d", "c", "b", "a"]
    first = (await store.list_runs(limit=1)).items[0]
    assert first == {"id": "e", "tenant": "default", "kind": "train", "created_at": T0 + timedelta(hours=2),
                     "env": None}
    acme = await store.list_runs(tenant="acme")
    assert [r["id"] for r in acme.items] == ["d", "b"] and acme.next_cursor is None
    with pytest.raises(InvalidCursor, match="belongs to the tasks listing, not runs"):
        await store.list_runs(cursor=encode_cursor("tasks", 1))
    with pytest.raises(InvalidCursor, match="not a cursor"):
        await store.list_runs(cursor=encode_cursor("runs", 7))


async def test_the_env_filter_takes_the_name_in_subjects_or_the_id_a_run_was_configured_with(store: Store) -> None:
    await store.upsert_runs([events.RunState(id="r1", config={"run": "r1", "env": "acme/math@1.2"}, created_at=T0),
                             events.RunState(id="r2", config={"run": "r2", "env": "other/math"}, created_at=T0)])
    await store.record([rollout("ro1", run="r1"), rollout("ro2", run="r2"), rollout("ro3", run="r3")])
    await store.upsert_runs([events.RunState(id="r1", created_at=T0)])  # a state without config keeps the env

    async def ids(env: str) -> set[str]:
        return {r["id"] for r in (await store.list_rollouts(RolloutFilter(env=env), limit=100)).items}

    assert await ids("math") == {"ro1", "ro2", "ro3"}  # every rollout's subject says math
    assert await ids("acme/math") == await ids("acme/math@1.2") == {"ro1"}  # the id run with, with or without version
    assert await ids("other/math") == {"ro2"} and await ids("acme/math@2.0") == set()
    assert await ids("acme/m%") == set()  # no pattern: the id as given
    run = await store.get_run("r1")
    assert run is not None and run["env"] == "acme/math@1.2"

    # A run with several environments: each rollout by its own environment's id (RunState.env_ids).
    several = events.RunState(id="r4", config={"run": "r4", "envs": [{"id": "acme/math@1.2"}, {"id": "acme/code"}]},
                              env_ids={"math": "acme/math@1.2", "code": "acme/code"}, created_at=T0)
    await store.upsert_runs([several, several])  # one state twice in a batch: its rows once
    await store.record([rollout("ro4", run="r4"), rollout("ro5", run="r4", env="code")])
    assert await ids("acme/math") == await ids("acme/math@1.2") == {"ro1", "ro4"}
    assert await ids("acme/code") == await ids("code") == {"ro5"} and await ids("acme/code@0.1") == set()
    # New ids in a new state replace the recorded ones; a state that does not name them keeps them.
    await store.upsert_runs([msgspec.structs.replace(several, env_ids={"math": "acme/math@2.0", "code": "acme/code"})])
    await store.upsert_runs([events.RunState(id="r4", created_at=T0)])
    assert await ids("acme/math@1.2") == {"ro1"} and await ids("acme/math@2.0") == {"ro4"}


# --- metering -----------------------------------------------------------------------------


def span(parent: events.Node | None, message: events.Message, prompt: list[int],
         sampled: list[int] = ()) -> events.Node:  # type: ignore[assignment]  # a tuple default: never mutated
    """A node whose span is ``prompt`` tokens (not sampled) then ``sampled`` ones, as an answer's is."""
    ids = list(prompt) + list(sampled)
    tokens = events.TokenSpan(token_ids=ids, logprobs=[0.0] * len(prompt) + [-0.5] * len(sampled),
                              loss_mask=[False] * len(prompt) + [True] * len(sampled),
                              policy_version=1 if sampled else None)
    parent_id = parent.id if parent else None
    return events.Node(id=events.node_id(parent_id, message, tokens), parent_id=parent_id, message=message,
                       tokens=tokens)


def tool_conversation() -> tuple[list[events.Node], events.RolloutUsage]:
    """system, user, an answer calling a tool (then a retry of it), the tool's result, the final
    answer: three model calls, with the prompt of each as the interception endpoint builds it."""
    system = span(None, events.Message(role="system", content="s"), [1, 2, 3])
    user = span(system, events.Message(role="user", content="q"), [4, 5])
    call = span(user, events.Message(role="assistant", content="c"), [6, 7], [8, 9, 10])
    retry = span(user, events.Message(role="assistant", content="r"), [6, 7], [11])
    result = span(call, events.Message(role="tool", content="4"), [12, 13, 14, 15])
    final = span(result, events.Message(role="assistant", content="f"), [16], [17, 18])
    # Prompts: 5 + 2, 5 + 2 (the retry), 5 + 5 + 4 + 1.
    return [system, user, call, retry, result, final], events.RolloutUsage(num_calls=3, prompt_tokens=7 + 7 + 15,
                                                                          sampled_tokens=3 + 1 + 2)


async def test_usage_is_summed_by_tenant_run_and_source_and_counted_once(store: Store) -> None:
    nodes, counted = tool_conversation()
    first = events.Rollout(id="ro1", run="r1", env="math", task_id="t1", group_id="t1", nodes=nodes, usage=counted,
                           created_at=T0)
    # A later copy of the rollout (a redelivery) with other counts changes nothing: the stored graph's stand.
    again = msgspec.structs.replace(first, usage=events.RolloutUsage(num_calls=9, prompt_tokens=99, sampled_tokens=9))
    plain = rollout("ro2", run="r1")  # published before metering: no usage, nothing counted for it
    step = events.Usage(id="r1.trainer.1", run="r1", source="trainer", step=1, trained_tokens=6 + 4, sft_tokens=5,
                        rollout_ids=["ro1", "ro2"], created_at=T0 + timedelta(seconds=5))
    api = events.Usage(id="api-1", run="r1", source="api", tenant="acme", prompt_tokens=40, sampled_tokens=8,
                       created_at=T0 + timedelta(seconds=10))
    sandbox = events.Usage(id="sandbox.b1@h", run="r1", source="sandbox", sandbox_s=2.5, rollout_id="ro1",
                           created_at=T0 + timedelta(seconds=3))
    await store.upsert_runs([events.RunState(id="r1", tenant="team", created_at=T0)])
    await store.record([first, plain, step, api, sandbox, sandbox])
    await store.record([again, step, msgspec.structs.replace(step, trained_tokens=1)])

    rows = await store.usage()
    by_source = {row["source"]: row for row in rows}
    assert [(row["tenant"], row["run"], row["source"]) for row in rows] == [
        ("acme", "r1", "api"), ("team", "r1", "rollout"), ("team", "r1", "sandbox"), ("team", "r1", "trainer")]
    assert by_source["rollout"] | {} == {"tenant": "team", "run": "r1", "source": "rollout", "num_counts": 1,
                                         "num_calls": 3, "prompt_tokens": 29, "sampled_tokens": 6, "trained_tokens": 0,
                                         "sft_tokens": 0, "sandbox_s": 0.0}
    assert by_source["sandbox"]["sandbox_s"] == 2.5 and by_source["sandbox"]["num_counts"] == 1
    assert (by_source["trainer"]["trained_tokens"], by_source["trainer"]["sft_tokens"]) == (10, 5)
    assert (by_source["api"]["prompt_tokens"], by_source["api"]["sampled_tokens"]) == (40, 8)
    assert [row["source"] for row in await store.usage(tenant="team")] == ["rollout", "sandbox", "trainer"]
    assert [row["source"] for row in await store.usage(since=T0 + timedelta(seconds=5),
                                                       until=T0 + timedelta(seconds=10))] == ["trainer"]
    assert await store.usage(run="r2") == []

    # The recount reads the stored graphs alone: ro1's three calls and ro2's one (5 prompt and 4
    # sampled tokens, which ro2 did not meter: the recount would show it), and the sampled tokens
    # of both trained rollouts, each node's once.
    assert await store.recount_usage("r1") == {"num_calls": 4, "prompt_tokens": 29 + 5, "sampled_tokens": 6 + 4,
                                              "trained_tokens": 6 + 4}


async def test_usage_over_time_is_summed_by_bucket_from_the_epoch(store: Store) -> None:
    day = datetime(2026, 11, 2, tzinfo=UTC)  # a bucket of a day starts at 00:00 UTC
    await store.upsert_runs([events.RunState(id="r1", tenant="team", created_at=T0),
                             events.RunState(id="r2", tenant="other", created_at=T0)])
    counts = [events.Usage(id=f"u{i}", run=run, source="trainer", step=i, trained_tokens=tokens, created_at=at)
              for i, (run, tokens, at) in enumerate([
                  ("r1", 1, day - timedelta(microseconds=1)), ("r1", 2, day), ("r1", 4, day + timedelta(hours=23)),
                  ("r1", 8, day + timedelta(days=2, seconds=30.5)), ("r2", 16, day)])]
    await store.record([*counts, events.Usage(id="api", run="r1", source="api", tenant="acme", prompt_tokens=7,
                                              sampled_tokens=3, created_at=day + timedelta(hours=1))])
    rows = await store.usage_over_time(86400, tenant="team")
    assert [(row["start"], row["trained_tokens"], row["num_counts"]) for row in rows] == [
        (day - timedelta(days=1), 1, 1), (day, 2 + 4, 2), (day + timedelta(days=2), 8, 1)]
    assert rows[0]["start"].tzinfo is UTC and rows[0]["sandbox_s"] == 0.0 and rows[0]["prompt_tokens"] == 0
    hourly = await store.usage_over_time(3600, since=day, until=day + timedelta(hours=2))
    assert [(row["start"], row["trained_tokens"], row["prompt_tokens"]) for row in hourly] == [
        (day, 2 + 16, 0), (day + timedelta(hours=1), 0, 7)]
    assert [row["trained_tokens"] for row in await store.usage_over_time(60, run="r1", since=day + timedelta(days=2))
            ] == [8]
    assert await store.usage_over_time(60, tenant="nobody") == []
    with pytest.raises(ValueError, match="bucket_s must be"):
        await store.usage_over_time(0)
