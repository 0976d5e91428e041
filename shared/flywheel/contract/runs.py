"""Runs in the run-state KV bucket: names, registration, reading and writing their state.

A run's :class:`flywheel.contract.events.RunState` (tenant, status, policy version, config) lives
under its id in the ``flywheel-runs`` bucket. A run belongs to the tenant that registered
it first; every writer (gateway, CLI, client, ``flywheel run``, orchestrator, trainer) goes
through here, so the rule and the name checks live once. Writers change a state by
compare-and-set (:func:`update_run`), so two writers (the trainer's step, the owner's lease)
never undo each other's fields.

Ownership: an orchestrator claims a run (:func:`claim_run`: a training run with a config,
not ended, with no owner or one whose lease expired, :func:`claimable`), renews its lease
(:func:`renew_lease`), and lets go of it at its end or its own (:func:`release_run`); each
by compare-and-set, so of two orchestrators one owns a run. :func:`stop_run` and
:func:`resume_run` are what ``flywheel runs stop|resume`` and the HTTP API do.

When a run stops taking tasks is decided once, by :func:`end_of`: it finished, failed or
was stopped, or its owner stopped renewing its lease (it was killed, or its machine is
gone) and no orchestrator took it yet. Inference skips the tasks such a run had queued and
dead-letters the ones published after its end; the gateway refuses new ones (409).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import msgspec
import nats.errors
import nats.js.api
import nats.js.errors

from flywheel.contract import events
from flywheel.contract.bus import RUNS_BUCKET, Bus, PermissionDenied, let_durable_expire, watch_bucket
from flywheel.contract.names import (
    check_key,
    check_run_id,
    is_run_id,
    path_name,
)

_decoder = events.Decoder(events.RunState)
log = logging.getLogger(__name__)

ENDED_STATUSES = ("finished", "failed", "stopped")


class RunConflict(ValueError):
    """The run exists and belongs to another tenant."""


class BadRunState(ValueError):
    """A run's entry in the runs bucket does not decode (something other than Flywheel wrote it)."""


@dataclass(frozen=True)
class RunEnd:
    """Why a run takes no more tasks, and since when."""

    status: str  # finished, failed, stopped, or abandoned (its owner's lease expired)
    since: datetime
    reason: str

    def __str__(self) -> str:
        return self.reason


def end_of(state: events.RunState, now: datetime | None = None) -> RunEnd | None:
    """Whether ``state``'s run has ended (None while it takes tasks): finished, failed or stopped,
    or ``running`` with a lease that expired before ``now`` (its owner is gone: ``abandoned``)."""
    if state.status in ENDED_STATUSES:
        since = state.ended_at or state.updated_at
        why = f" ({state.reason})" if state.reason else ""
        return RunEnd(state.status, since, f"run {state.id!r} {state.status} at {since.isoformat()}{why}")
    expires = state.lease_expires_at
    if expires is not None and expires < (now or events.utc_now()):
        owner = state.owner or "its owner"
        return RunEnd("abandoned", expires, f"run {state.id!r} is abandoned: {owner} stopped renewing its lease, which "
                                            f"expired at {expires.isoformat()}; a live orchestrator takes it over "
                                            "(`flywheel up` runs one)")
    return None


def scorers_of(state: events.RunState, env: str) -> dict[str, float]:
    """The scorers whose weighted values make the reward of the run's rollouts of ``env`` (its
    name in subjects), name -> weight: its own in a run with several environments, else the
    run's (:attr:`flywheel.contract.events.RunState.env_scorers`)."""
    return dict(state.env_scorers.get(env, state.scorers))


def decode_state(key: str, value: bytes) -> events.RunState:
    """A runs-bucket entry as a RunState; :class:`BadRunState` naming the key when it does not decode."""
    try:
        return _decoder.decode(value)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise BadRunState(f"run {key!r}: its entry in the {RUNS_BUCKET} KV bucket is not a run state ({exc}); "
                          f"delete or rewrite the key") from None


async def get_run(bus: Bus, run: str) -> events.RunState | None:
    """The run's state; None when it has none; :class:`BadRunState` when its entry does not decode."""
    kv = await bus.runs_kv()
    try:
        entry = await bus.retry(lambda: kv.get(run))
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    return decode_state(run, entry.value) if entry.value else None


def task_durable(run: str) -> str:
    """The durable through which inference consumes ``run``'s tasks."""
    return f"inference-{path_name(run)}"


# The streams whose events a run's own consumers read, each filtered on ``<subject>.<run>.…``:
# inference's of its tasks, its trainer's, its teachers'.
RUN_STREAMS = ("TASKS", "ROLLOUTS", "SCORES", "SIGNALS")


def consumer_run(config: nats.js.api.ConsumerConfig) -> str | None:
    """The one run whose events a consumer reads: every filter subject of its ``config`` names
    that run as its second token (a run id has no '.'); None for a consumer of every run or of
    several (the built-in scorer, a custom scorer, inference's screen)."""
    subjects = [config.filter_subject] if config.filter_subject else []
    subjects += list(config.filter_subjects or [])
    runs = {subject.split(".")[1] if subject.count(".") else "" for subject in subjects}
    if len(runs) != 1:
        return None
    (run,) = runs
    return run if is_run_id(run) else None


def consumer_row(stream: str, info: nats.js.api.ConsumerInfo) -> dict[str, Any]:
    """What ``flywheel status`` and a run's page show of a consumer: its lag, whose it is
    (``run``: :func:`consumer_run`), and whether a process reads it now (``pulled``: a pull
    request waits on it, or it holds deliveries not acked; else it is idle, as a stopped
    scorer's durable is, ``last_active`` its last delivery)."""
    delivered = info.delivered
    return {"stream": stream, "consumer": info.name, "num_pending": info.num_pending or 0,
            "num_ack_pending": info.num_ack_pending or 0, "num_redelivered": info.num_redelivered or 0,
            "num_waiting": info.num_waiting or 0, "run": consumer_run(info.config),
            "pulled": bool(info.num_waiting or info.num_ack_pending),
            "last_active": delivered.last_active if delivered is not None else None}


def trainer_durables(run: str) -> dict[str, str]:
    """The durables of ``run``'s trainer, by stream."""
    return {stream: f"trainer-{path_name(run)}-{stream.lower()}" for stream in ("ROLLOUTS", "SCORES", "SIGNALS")}


def teacher_durable(run: str, teacher: str) -> str:
    """The durable (on ROLLOUTS) of ``run``'s teacher ``teacher``."""
    return f"teacher-{path_name(run)}-{teacher}"


# A run's durables (its trainer's, its teachers'): the server deletes one after an hour
# without a pull (its reader died), or LET_GO_S after the run ended and its reader stopped.
DURABLE_INACTIVE_S = 3600.0
LET_GO_S = 10.0


async def let_run_durables_go(bus: Bus, run: str, durables: Iterable[tuple[str, str]], whose: str) -> None:
    """``run`` ended: its (stream, name) ``durables``, read by the caller (``whose``, for the
    log) and no more, expire :data:`LET_GO_S` after its last pull (:func:`let_durable_expire`:
    an update of its own durable, which least privilege allows where a delete is not). One that
    cannot be set so is said, and expires after :data:`DURABLE_INACTIVE_S` instead."""
    try:
        for stream, name in durables:
            await let_durable_expire(bus, stream, name, LET_GO_S)
    except (TimeoutError, nats.errors.Error, PermissionDenied) as exc:
        log.warning("run %s: %s durables could not be let go (%s: %s); they expire after %gs unused", run, whose,
                    type(exc).__name__, exc, DURABLE_INACTIVE_S)
    else:
        log.info("run %s: ended; %s durables expire %gs after their last pull", run, whose, LET_GO_S)


# What list_runs said of entries that do not decode: each said once per process (a caller that
# lists every second would say it every second), at most this many remembered.
_SAID_BAD: set[str] = set()
MAX_SAID_BAD = 1024


async def list_runs(bus: Bus) -> list[events.RunState]:
    """Every run's current state; an entry that does not decode is left out, and logged once."""
    states = []
    for key in await bus.kv_keys(RUNS_BUCKET):
        try:
            state = await get_run(bus, key)
        except BadRunState as exc:
            if str(exc) not in _SAID_BAD:
                if len(_SAID_BAD) >= MAX_SAID_BAD:
                    _SAID_BAD.clear()
                _SAID_BAD.add(str(exc))
                log.warning("%s (said once; it is left out of every listing until it is rewritten)", exc)
            continue
        if state is not None:
            states.append(state)
    return states


async def get_or_create_run(bus: Bus, run: str, tenant: str = "default", config: dict[str, Any] | None = None,
                            kind: str = "train", scorers: Mapping[str, float] | None = None,
                            env_scorers: Mapping[str, Mapping[str, float]] | None = None,
                            env_ids: Mapping[str, str] | None = None, prepared: bool = True
                            ) -> tuple[events.RunState, bool]:
    """The run's state, created (owned by ``tenant``, with ``config``, of ``kind`` train or eval,
    its reward made of ``scorers``, ``env_scorers`` and ``env_ids`` for a run with several
    environments: see :attr:`flywheel.contract.events.RunState.scorers`; ``prepared`` False for
    a config as a tenant gave it, which its orchestrator prepares) if new; ``(state, created)``.
    An existing run is returned as it is, whoever owns it."""
    check_run_id(run)
    check_key("tenant", tenant)
    kv = await bus.runs_kv()
    for _ in range(2):  # a second pass only when another writer created it meanwhile
        state = await get_run(bus, run)
        if state is not None:
            return state, False
        state = events.RunState(id=run, tenant=tenant, config=config or {},
                                kind=kind,  # type: ignore[arg-type]  # callers pass "train" or "eval"
                                scorers=dict(scorers or {}),
                                env_scorers={env: dict(by_name) for env, by_name in (env_scorers or {}).items()},
                                env_ids=dict(env_ids or {}), prepared=prepared)
        try:
            await kv.create(run, events.encode(state))
            return state, True
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"run {run!r}: the run-state key changed twice while it was being created")


async def register_run(bus: Bus, run: str, tenant: str = "default", config: dict[str, Any] | None = None,
                       kind: str = "train", scorers: Mapping[str, float] | None = None,
                       env_scorers: Mapping[str, Mapping[str, float]] | None = None,
                       env_ids: Mapping[str, str] | None = None, prepared: bool = True
                       ) -> tuple[events.RunState, bool]:
    """Like :func:`get_or_create_run`, but a run of another tenant is a :class:`RunConflict`."""
    state, created = await get_or_create_run(bus, run, tenant, config, kind, scorers, env_scorers, env_ids,
                                             prepared)
    if state.tenant != tenant:
        raise RunConflict(f"run {run!r} belongs to tenant {state.tenant!r}, not {tenant!r}; "
                          "name another run or use its owner's tenant")
    return state, created


async def update_run(bus: Bus, run: str, **changes: Any) -> events.RunState:
    """Replace fields of an existing run's state (``updated_at`` is set); returns the new state.

    Compare-and-set on the entry's revision, read again after a concurrent write, so fields
    another writer changed meanwhile are kept (a retried update whose first try did land
    fails on the revision: read again, the changes, absolute values, are written over the
    state they made)."""
    state = await _swap(bus, run, lambda state: msgspec.structs.replace(state, **changes))
    if state is None:
        raise ValueError(f"run {run!r} is not registered")
    return state


class RunNotFound(ValueError):
    """No run of that id in the run-state bucket."""


async def stop_run(bus: Bus, run: str, by: str, tenant: str | None = None) -> events.RunState:
    """Mark ``run`` stopped (``by`` says who, in its reason): it takes no more tasks, and its owner
    stops its trainer (which checkpoints first). Returns the new state; a run that had ended
    already is returned as it is. :class:`RunNotFound`, or :class:`RunConflict` when ``tenant``
    is given and does not own it."""
    state = await get_run(bus, run)
    if state is None:
        raise RunNotFound(f"run {run!r} is not in the {RUNS_BUCKET} KV bucket; `flywheel runs list` lists the runs")
    if tenant is not None and state.tenant != tenant:
        raise RunConflict(f"run {run!r} belongs to tenant {state.tenant!r}, not {tenant!r}")
    if state.status in ENDED_STATUSES:
        return state
    now = events.utc_now()
    return await update_run(bus, run, status="stopped", ended_at=now,
                            reason=f"stopped by {by} at step {state.trainer_step}")


async def trainer_started(bus: Bus, run: str, trainer_step: int, policy_version: int) -> None:
    """The run's trainer published its weights and trains: its step and version, and ``running``
    unless someone paused or ended the run meanwhile (that stays as it is)."""
    await _swap(bus, run, lambda state: msgspec.structs.replace(
        state, trainer_step=trainer_step, policy_version=policy_version,
        status="running" if state.status == "created" else state.status))


async def pause_run(bus: Bus, run: str, by: str, tenant: str | None = None) -> events.RunState:
    """Mark ``run`` paused (``by`` says who, in its reason): its owner stops its trainer (which
    checkpoints first) and holds the run, its queued tasks kept, until :func:`resume_run`
    (or :func:`stop_run`). :class:`RunNotFound`; :class:`RunConflict` for another tenant's run;
    a ValueError for a run that ended. A paused run is returned as it is."""
    def change(state: events.RunState) -> events.RunState | None:
        if tenant is not None and state.tenant != tenant:
            raise RunConflict(f"run {run!r} belongs to tenant {state.tenant!r}, not {tenant!r}")
        end = end_of(state)
        if end is not None:
            raise ValueError(f"{end.reason}: only a run that goes on can be paused")
        if state.status == "paused":
            return None
        return msgspec.structs.replace(state, status="paused", reason=f"paused by {by} at step {state.trainer_step}")

    paused = await _swap(bus, run, change)
    if paused is not None:
        return paused
    state = await get_run(bus, run)
    if state is None:
        raise RunNotFound(f"run {run!r} is not in the {RUNS_BUCKET} KV bucket; `flywheel runs list` lists the runs")
    return state


def check_resumable(state: events.RunState | None, run: str) -> events.RunState:
    """``state`` when its run can be resumed: it exists, has a config, did not finish, and nobody
    is running it (paused, stopped, failed, or abandoned by its owner); else a ValueError saying why."""
    if state is None:
        raise RunNotFound(f"run {run!r} is not in the {RUNS_BUCKET} KV bucket; `flywheel runs list` lists the runs")
    if state.kind != "train" or not state.config:
        raise ValueError(f"run {run!r} is not a training run started from a config (kind {state.kind!r}); "
                         "there is nothing to resume")
    if state.status == "finished":
        raise ValueError(f"run {run!r} finished already; start a new run to train further")
    now = events.utc_now()
    if state.status in ENDED_STATUSES and lease_held(state, now):
        raise ValueError(f"run {run!r} is {state.status}, but its owner {state.owner} is still stopping it (its "
                         "trainer checkpoints first); try again in a few seconds")
    if end_of(state, now) is None and state.status != "paused":
        owner = state.owner or "its owner"
        raise ValueError(f"run {run!r} is still {state.status} (owned by {owner}, lease until "
                         f"{state.lease_expires_at.isoformat() if state.lease_expires_at else 'unset'}); "
                         f"stop it first (`flywheel runs stop {run}`), or follow it (`flywheel runs follow {run}`)")
    return state


def lease_held(state: events.RunState, now: datetime | None = None) -> bool:
    """Whether an owner holds ``state``'s run: one is named and its lease has not expired."""
    return (state.owner is not None and state.lease_expires_at is not None
            and state.lease_expires_at >= (now or events.utc_now()))


def claimable(state: events.RunState, now: datetime | None = None) -> bool:
    """Whether an orchestrator may take ``state``'s run: a training run with a config, not ended
    (finished, failed, stopped), whose owner is none or let its lease expire."""
    if state.kind != "train" or not state.config or state.status in ENDED_STATUSES:
        return False
    return not lease_held(state, now)


async def _swap(bus: Bus, run: str, change: Callable[[events.RunState], events.RunState | None]
                ) -> events.RunState | None:
    """Compare-and-set on the run's entry: ``change`` the state read (None: leave it); retried
    when another writer got in between. The new state, or None when ``change`` left it."""
    kv = await bus.runs_kv()
    for _ in range(100):
        try:
            entry = await bus.retry(lambda: kv.get(run))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if not entry.value:
            return None
        new = change(decode_state(run, entry.value))
        if new is None:
            return None
        new = msgspec.structs.replace(new, updated_at=events.utc_now())
        try:
            await bus.retry(functools.partial(kv.update, run, events.encode(new), last=entry.revision))
            return new
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"run {run!r}: its run-state entry kept changing while it was being updated")


async def claim_run(bus: Bus, run: str, owner: str, lease_s: float) -> events.RunState | None:
    """Become ``run``'s owner if it is :func:`claimable` (or ours already): the new state, or None
    when it is not to be taken (another owner holds it, or it ended)."""
    def change(state: events.RunState) -> events.RunState | None:
        if state.owner != owner and not claimable(state):
            return None
        return msgspec.structs.replace(state, owner=owner,
                                       lease_expires_at=events.utc_now() + timedelta(seconds=lease_s))
    return await _swap(bus, run, change)


async def prepared_run(bus: Bus, run: str, owner: str, config: dict[str, Any], scorers: Mapping[str, float],
                       env_scorers: Mapping[str, Mapping[str, float]], env_ids: Mapping[str, str]
                       ) -> events.RunState | None:
    """``owner`` writes the prepared config of a run registered over HTTP (:attr:`RunState.prepared`);
    None when it no longer holds the run."""
    def change(state: events.RunState) -> events.RunState | None:
        if state.owner != owner:
            return None
        return msgspec.structs.replace(state, config=config, scorers=dict(scorers), prepared=True,
                                       env_scorers={env: dict(by) for env, by in env_scorers.items()},
                                       env_ids=dict(env_ids))
    return await _swap(bus, run, change)


async def renew_lease(bus: Bus, run: str, owner: str, lease_s: float) -> events.RunState | None:
    """Push ``owner``'s lease on ``run`` on; None when ``owner`` no longer holds it."""
    def change(state: events.RunState) -> events.RunState | None:
        if state.owner != owner:
            return None
        return msgspec.structs.replace(state, lease_expires_at=events.utc_now() + timedelta(seconds=lease_s))
    return await _swap(bus, run, change)


async def release_run(bus: Bus, run: str, owner: str, **changes: Any) -> events.RunState | None:
    """``owner`` lets go of ``run`` (no owner, no lease), with ``changes`` (an end); None when it
    did not hold it any more."""
    def change(state: events.RunState) -> events.RunState | None:
        if state.owner != owner:
            return None
        return msgspec.structs.replace(state, owner=None, lease_expires_at=None, **changes)
    return await _swap(bus, run, change)


async def add_note(bus: Bus, run: str, note: str) -> None:
    """Append ``note`` to the run's notes (the last ``MAX_NOTES`` are kept): the owner's word
    for people, which ``flywheel run`` and ``flywheel runs follow`` print."""
    def change(state: events.RunState) -> events.RunState:
        return msgspec.structs.replace(state, notes=[*state.notes, note][-events.MAX_NOTES:],
                                       num_notes=state.num_notes + 1)
    await _swap(bus, run, change)


async def add_eval_point(bus: Bus, run: str, point: events.EvalPoint) -> None:
    """Append an eval's figures to the run's state (the latest ``MAX_EVAL_POINTS`` kept), where
    the gateway and its run page read them; one of the same eval and step is replaced."""
    def change(state: events.RunState) -> events.RunState:
        kept = [p for p in state.evals if (p.eval, p.step) != (point.eval, point.step)]
        return msgspec.structs.replace(state, evals=[*kept, point][-events.MAX_EVAL_POINTS:])
    await _swap(bus, run, change)


async def pin_version(bus: Bus, run: str, version: int) -> None:
    """Keep weight version ``version`` of the run in its bucket for an eval
    (``RunState.pinned_versions``) until :func:`unpin_version`."""
    await _swap(bus, run, lambda state: None if version in state.pinned_versions else msgspec.structs.replace(
        state, pinned_versions=sorted([*state.pinned_versions, version])))


async def unpin_version(bus: Bus, run: str, version: int) -> None:
    """Let go of a weight version kept for an eval (``RunState.pinned_versions``): the trainer
    drops it with the next version it publishes, unless it is among the newest kept."""
    await _swap(bus, run, lambda state: msgspec.structs.replace(
        state, pinned_versions=[v for v in state.pinned_versions if v != version])
        if version in state.pinned_versions else None)


def new_notes(state: events.RunState, seen: int) -> list[str]:
    """The notes of ``state`` after the first ``seen`` (those still kept)."""
    fresh = max(0, state.num_notes - seen)
    return state.notes[len(state.notes) - min(fresh, len(state.notes)):] if fresh else []


async def resume_run(bus: Bus, run: str, tenant: str | None = None) -> events.RunState:
    """Make a stopped, failed or abandoned run claimable again (:func:`check_resumable` says
    why not otherwise): an orchestrator takes it and goes on from its last checkpoint. A paused
    run goes on with its owner (it starts the trainer again)."""
    def change(state: events.RunState) -> events.RunState:
        check_resumable(state, run)
        if tenant is not None and state.tenant != tenant:
            raise RunConflict(f"run {run!r} belongs to tenant {state.tenant!r}, not {tenant!r}")
        if state.status == "paused" and end_of(state) is None:  # its owner holds it: it goes on there
            return msgspec.structs.replace(state, status="running" if state.trainer_step or state.policy_version
                                           else "created", reason=None)
        return msgspec.structs.replace(state, status="running" if state.trainer_step or state.policy_version
                                       else "created", ended_at=None, reason=None, owner=None,
                                       lease_expires_at=None)
    state = await _swap(bus, run, change)
    if state is None:
        raise RunNotFound(f"run {run!r} is not in the {RUNS_BUCKET} KV bucket; `flywheel runs list` lists the runs")
    return state


async def watch_runs(bus: Bus, stopping: asyncio.Event,
                     on_state: Callable[[events.RunState], Awaitable[None]]) -> None:
    """Call ``on_state`` with every run's current state, then with every change, until ``stopping``.

    An entry that does not decode is logged and skipped (the run's readers get
    :class:`BadRunState` from :func:`get_run`); it never stops the watch."""
    async for key, value in watch_bucket(await bus.runs_kv(), stopping):
        try:
            state = decode_state(key, value)
        except BadRunState as exc:
            log.warning("%s", exc)
            continue
        await on_state(state)
