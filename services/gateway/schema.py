"""The trace store's tables (SQLAlchemy Core), shared by the store and the migrations.

Every table is keyed by the id of the event it records (``run_metrics`` by run and step), so
recording an event twice (the bus delivers at least once) changes nothing. Tables that the API lists page by page
(``tasks``, ``rollouts``) also carry ``seq``, an autoincrement in recording order: a
keyset cursor on it never skips or repeats a row while new rows arrive.

No foreign keys: events arrive in any order (a score may be recorded before its rollout,
a live trace node before its rollout), so every table accepts rows whose neighbours have
not arrived yet.

Times are stored in UTC. SQLite keeps no time zone, so it hands back naive datetimes;
:class:`UTCDateTime` converts to UTC on the way in and marks values as UTC on the way out,
so callers always get aware datetimes on both SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect


class UTCDateTime(sa.TypeDecorator[datetime]):
    """An aware datetime, stored in UTC; naive values read back (SQLite) are marked UTC."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()} given to the trace store; "
                             "pass an aware (UTC) datetime")
        value = value.astimezone(UTC)
        # SQLite would format the offset away anyway; store the plain UTC wall time.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# JSON on SQLite, JSONB on PostgreSQL. Values are (de)serialized by the engine's
# json_serializer (msgspec, see store.create_engine), so msgspec Structs can be bound as is.
Json = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
# An INTEGER PRIMARY KEY is SQLite's rowid (autoincrement); BIGINT on PostgreSQL.
Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

metadata = sa.MetaData()


def _seq() -> sa.Column[Any]:
    return sa.Column("seq", Seq, primary_key=True, autoincrement=True)


runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("tenant", sa.String, nullable=False),
    sa.Column("kind", sa.String, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    # The environment id its config names (owner/name[@version] or a module name): the trace
    # API's env= filter takes it as well as the name in the rollouts' subjects. Null: no config.
    sa.Column("env", sa.String, nullable=True),
)

# The environments of a run with several (RunState.env_ids): each one's id in the run config
# (owner/name[@version], a module, a path) by its name in subjects, so the trace API's env=
# filter finds a rollout by the id a user ran it with (a run with one has it in runs.env).
run_envs = sa.Table(
    "run_envs",
    metadata,
    sa.Column("run", sa.String, primary_key=True),
    sa.Column("env", sa.String, primary_key=True),
    sa.Column("env_id", sa.String, nullable=False),
)

# The scorers whose weighted values make a run's reward, mirrored from its state in the
# run-state bucket: a rollout's reward is the weighted sum of theirs (store_reward.reward_expression).
# env '': every environment of the run (a run with one: RunState.scorers); else the rows of
# that environment, its name in subjects (a run with several: RunState.env_scorers). A run
# has rows of one kind or the other, never both. A rollout without rows (its run has none,
# or none of its environment) counts every score at its own weight.
run_scorers = sa.Table(
    "run_scorers",
    metadata,
    sa.Column("run", sa.String, primary_key=True),
    sa.Column("env", sa.String, primary_key=True, server_default=""),
    sa.Column("scorer", sa.String, primary_key=True),
    sa.Column("weight", sa.Float, nullable=False),
)

tasks = sa.Table(
    "tasks",
    metadata,
    _seq(),
    sa.Column("id", sa.String, nullable=False, unique=True),
    sa.Column("run", sa.String, nullable=False),
    sa.Column("env", sa.String, nullable=False),
    sa.Column("data", Json, nullable=False),
    sa.Column("num_rollouts", sa.Integer, nullable=False),
    sa.Column("sampling", Json, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Index("ix_tasks_run_env", "run", "env"),
)

rollouts = sa.Table(
    "rollouts",
    metadata,
    _seq(),
    sa.Column("id", sa.String, nullable=False, unique=True),
    sa.Column("run", sa.String, nullable=False),
    sa.Column("env", sa.String, nullable=False),
    sa.Column("task_id", sa.String, nullable=False, index=True),
    sa.Column("group_id", sa.String, nullable=False, index=True),
    sa.Column("index", sa.Integer, nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False),
    sa.Column("status", sa.String, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    # The rollout's reward (flywheel.sdk.scoring.rollout_reward, in SQL: store_reward.reward_expression):
    # the weighted sum of its run's scorers' values; NULL until each has scored it, when one
    # failed on it, and when the rollout is an error.
    sa.Column("reward", sa.Float, nullable=True),
    sa.Column("num_tokens", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    # The whole Rollout event as published (nodes included), for replay and export.
    sa.Column("event", Json, nullable=False),
    # The listing's common shapes, newest first: a run's rollouts, a run's rollouts of one env.
    sa.Index("ix_rollouts_run_seq", "run", "seq"),
    sa.Index("ix_rollouts_run_env_seq", "run", "env", "seq"),
)

# One row per distinct node (content hash), however many rollouts share it.
nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("parent_id", sa.String, nullable=True),
    sa.Column("role", sa.String, nullable=False),
    sa.Column("message", Json, nullable=False),
    # TokenSpan: token_ids, logprobs, loss_mask, policy_version; NULL for a node without tokens.
    sa.Column("tokens", Json, nullable=True),
    sa.Column("policy_version", sa.Integer, nullable=True),
)

# Which nodes make up a rollout's graph, in the order the rollout lists them.
rollout_nodes = sa.Table(
    "rollout_nodes",
    metadata,
    sa.Column("rollout_id", sa.String, primary_key=True),
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("position", sa.Integer, nullable=False),
)

scores = sa.Table(
    "scores",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("run", sa.String, nullable=False),
    sa.Column("env", sa.String, nullable=False),
    sa.Column("rollout_id", sa.String, nullable=False),
    sa.Column("group_id", sa.String, nullable=False),
    sa.Column("scorer", sa.String, nullable=False),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("weight", sa.Float, nullable=False),
    sa.Column("components", Json, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    # One verdict per scorer per rollout: a scorer that scores a redelivered rollout again
    # under a new event id must not count twice in the reward.
    sa.UniqueConstraint("rollout_id", "scorer", name="uq_scores_rollout_scorer"),
)

# A teacher's per-token logprobs of a rollout's sampled tokens (SIGNALS): ``values`` maps each
# node holding sampled tokens to one value per token of its span. One per teacher per rollout.
# The top-k lists a dense distillation term reads are not kept (k times the values' size).
signals = sa.Table(
    "signals",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("run", sa.String, nullable=False),
    sa.Column("env", sa.String, nullable=False),
    sa.Column("rollout_id", sa.String, nullable=False),
    sa.Column("source", sa.String, nullable=False),
    sa.Column("model", sa.String, nullable=False),
    sa.Column("temperature", sa.Float, nullable=False),
    sa.Column("values", Json, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.UniqueConstraint("rollout_id", "source", name="uq_signals_rollout_source"),
)

weight_updates = sa.Table(
    "weight_updates",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("run", sa.String, nullable=False, index=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("uri", sa.String, nullable=False),
    sa.Column("sha256", sa.String, nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("format", sa.String, nullable=False),
    sa.Column("trainer_step", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

# One row per training step of a run, from the step's weight update: the figures the
# trainer reports (loss, reward_mean, staleness, throughput, ...) as one JSON object, so a
# new figure needs no migration. Keyed by (run, step): the first update of a step wins.
run_metrics = sa.Table(
    "run_metrics",
    metadata,
    sa.Column("run", sa.String, primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("metrics", Json, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

dead_letters = sa.Table(
    "dead_letters",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("stream", sa.String, nullable=False, index=True),
    sa.Column("original_subject", sa.String, nullable=False),
    sa.Column("consumer", sa.String, nullable=False),
    sa.Column("num_delivered", sa.Integer, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    sa.Column("headers", Json, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

# Metering: what each run used, one row per count (a rollout's model calls, recorded with the
# rollout it rode in; a trainer step's; an API request's; a sandbox's). ``tenant`` is who pays where the
# count names one (an API caller's key); NULL: the run's owner (``runs.tenant``).
usage = sa.Table(
    "usage",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("run", sa.String, nullable=False),
    sa.Column("source", sa.String, nullable=False),  # rollout, trainer, sft, api
    sa.Column("tenant", sa.String, nullable=True),
    sa.Column("step", sa.Integer, nullable=True),
    sa.Column("rollout_id", sa.String, nullable=True),
    sa.Column("num_calls", sa.Integer, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
    sa.Column("sampled_tokens", sa.BigInteger, nullable=False),
    sa.Column("trained_tokens", sa.BigInteger, nullable=False),
    sa.Column("sft_tokens", sa.BigInteger, nullable=False),
    sa.Column("sandbox_s", sa.Float, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Index("ix_usage_run_created_at", "run", "created_at"),
    sa.Index("ix_usage_created_at", "created_at"),
)

# Which step trained each rollout (from the trainer's usage events): the first record wins.
trained_rollouts = sa.Table(
    "trained_rollouts",
    metadata,
    sa.Column("rollout_id", sa.String, primary_key=True),
    sa.Column("run", sa.String, nullable=False, index=True),
    sa.Column("step", sa.Integer, nullable=False),
)

# The environment hub: environments by id (owner/name), their versions (immutable once pushed)
# and each version's package files. The files live here, beside their metadata, so a push is
# one transaction: a refused one stores nothing, and a version never lacks its files.
hub_environments = sa.Table(
    "hub_environments",
    metadata,
    sa.Column("id", sa.String, primary_key=True),  # owner/name
    sa.Column("owner", sa.String, nullable=False),  # the tenant that owns it
    # Its package's distribution name, normalized (owner-name): what the package index serves it as.
    sa.Column("project", sa.String, nullable=False, unique=True),
    sa.Column("private", sa.Boolean, nullable=False),
    sa.Column("forked_from", sa.String, nullable=True),  # owner/name@version it was forked from
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Index("ix_hub_environments_owner", "owner"),
)

hub_versions = sa.Table(
    "hub_versions",
    metadata,
    sa.Column("env_id", sa.String, primary_key=True),
    sa.Column("version", sa.String, primary_key=True),
    sa.Column("sha256", sa.String, nullable=False),  # the wheel's: the version's content hash
    sa.Column("summary", sa.String, nullable=False),
    sa.Column("readme", sa.Text, nullable=False),
    sa.Column("pushed_by", sa.String, nullable=True),  # the API key's id; NULL: an open gateway
    sa.Column("created_at", UTCDateTime, nullable=False),
)

hub_files = sa.Table(
    "hub_files",
    metadata,
    sa.Column("filename", sa.String, primary_key=True),  # a wheel's or sdist's name: it names project and version
    sa.Column("env_id", sa.String, nullable=False),
    sa.Column("version", sa.String, nullable=False),
    sa.Column("kind", sa.String, nullable=False),  # wheel, sdist
    sa.Column("sha256", sa.String, nullable=False),
    sa.Column("size_bytes", sa.Integer, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Index("ix_hub_files_env_id_version", "env_id", "version"),
)

# Evals pushed to an environment version (`flywheel eval --push`): its leaderboard. The
# figures a leaderboard sorts and shows are columns; the whole summary is kept beside them.
hub_evals = sa.Table(
    "hub_evals",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("env_id", sa.String, nullable=False),
    sa.Column("version", sa.String, nullable=False),
    sa.Column("model", sa.String, nullable=False),
    sa.Column("reward_mean", sa.Float, nullable=True),  # NULL: no rollout was scored
    sa.Column("reward_stderr", sa.Float, nullable=True),
    sa.Column("pass_at", Json, nullable=False),  # {"pass@1": ..., "pass@k": ...}
    sa.Column("num_tasks", sa.Integer, nullable=False),
    sa.Column("num_rollouts", sa.Integer, nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("tenant", sa.String, nullable=False),  # who pushed it
    sa.Column("pushed_by", sa.String, nullable=True),  # the API key's id; NULL: an open gateway
    sa.Column("summary", Json, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Index("ix_hub_evals_env_id_version", "env_id", "version"),
)
