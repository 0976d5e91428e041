"""One run's owner: its lease, its trainer, its task supply, its end.

A :class:`RunOwner` lives in the orchestrator from the moment it claims a run
(:func:`flywheel.contract.runs.claim_run`) until the run ends or another owner has it:

1. keeps the lease (renewed every third of ``run_lease_s``; a renewal that finds another
   owner ends this one at once, without writing anything);
2. starts the run's trainer (``python -m flywheel_trainer --run RUN``, under torch's launcher
   with the setting ``trainer.ranks`` above 1, log in the run folder;
   once a trainer of the run left by a dead owner has stopped beating, so two never share the
   run folder) and keeps it running: a trainer that dies is started again with backoff and resumes from
   its checkpoint and journal; after ``MAX_RESTARTS_WITHOUT_PROGRESS`` restarts without a new
   step in between, the run is marked ``failed`` with the reason;
3. publishes the environments' tasks (the task supply): a group for every step left, what
   the staleness bound lets inference run ahead, and one group for each group's worth of
   rollouts the trainer dropped (each weight update says how many). A run with several
   environments mixes them by weight (:meth:`flywheel.contract.config.RunConfig.env_schedule`:
   task position p is of the same environment for every owner). Their count is kept in the
   run state, so a run claimed again goes on from there; a run claimed after it had ended
   or lost its owner (inference released its queued tasks then) gets tasks for the steps
   left. Every ``RECONCILE_S`` it compares what it believes published with what the bus
   holds: when the TASKS stream holds none of the run's tasks (purged, deleted), or when no
   task of the run waits or is being rolled out and no step came for ``STALL_S`` (tasks lost
   some other way), or when its lease lapsed before it could renew it (the bus refusing
   writes: inference released the tasks it held), it publishes what the run still needs,
   once for each such finding;
4. runs the run's evals (``[[evals]]``) as their steps' weights come out: each through
   ``flywheel eval``'s machinery (:func:`flywheel.runtime.evaluation.run_eval`) against inference's
   OpenAI API with ``model = RUN@STEP`` (the weights of that step, which the trainer keeps
   pinned until the eval is done), recorded as an eval run ``RUN-eval-NAME-STEP`` of the
   run's tenant, linked to the run and step, one eval at a time beside training; each result is a note, a line of
   ``evals.jsonl`` in the run folder and a point in ``reward.png``. Evals whose weights are
   still pinned when an owner claims the run, or when its trainer finishes, are run then;
   the run is let go once they are done;
5. says what it does as notes on the run state (:func:`flywheel.contract.runs.add_note`),
   which ``flywheel run`` and ``flywheel runs follow`` print;
6. ends: when the trainer finished the run; when the run is marked ``stopped`` (``flywheel
   runs stop``, the API, Ctrl-C of ``flywheel run``), the trainer is stopped (it checkpoints
   first); when the orchestrator stops, likewise, and the run is left ``running`` without an
   owner, for the next orchestrator to claim. At a run's end it writes ``summary.json`` and
   ``reward.png`` in the run folder, beside the trainer's ``metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors

from flywheel.contract import events, weights
from flywheel.contract.bus import SERVICE_HEARTBEAT_TTL_S, Bus, PayloadTooLarge, wait_at_most, watch
from flywheel.contract.checkpoints import run_folder
from flywheel.contract.config import EvalSpec, RunConfig
from flywheel.contract.retry import Backoff
from flywheel.contract.runs import (
    add_eval_point,
    add_note,
    get_run,
    prepared_run,
    release_run,
    renew_lease,
    task_durable,
    unpin_version,
    update_run,
)
from flywheel.contract.service import read_heartbeats
from flywheel.contract.settings import Settings
from flywheel.runtime.environments import WorkerPool
from flywheel.runtime.evaluation import EvalConfig, run_eval
from flywheel.runtime.reporting import Progress, plot, summarize
from flywheel.runtime.runs import RunEnvironment, config_ids, load_run_environments, prepare_run
from flywheel.runtime.supervise import (
    RestartBackoff,
    ServiceProcess,
    ServiceSpec,
    exit_text,
    heartbeat_of,
    trainer_env,
    wait_set,
)
from flywheel.runtime.tasks import make_tasks
from flywheel.sdk.scoring import describe_reward, reward_definition

log = logging.getLogger(__name__)

MAX_RESTARTS_WITHOUT_PROGRESS = 5  # trainer restarts with no new step in between before the run fails
STATE_CHECK_S = 1.0  # how often the owner reads its run's state (a stop, another owner)
TRAINER_STOP_S = 15.0  # a trainer asked to stop gets this long to checkpoint
# A run's trainer serves its metrics at the orchestrator's metrics_port + this + its slot (the
# lowest free among the orchestrator's runs): past the ports `flywheel up` gives its services.
TRAINER_METRICS_OFFSET = 10
WATCH_END_S = 5.0  # a cancelled watch of the run's weights gets this long to unsubscribe
RECONCILE_S = 10.0  # how often the owner compares what it published with what TASKS holds
STALL_S = 60.0  # no step for this long, and no task of the run waiting or in flight: tasks were lost
EVAL_FIGURES = ("reward_mean", "reward_stderr", "pass@1", "num_tasks", "num_rollouts", "num_errors")  # in evals.jsonl


class RunFailed(Exception):
    """The run cannot go on (its trainer keeps failing)."""


class TrainerSupervisor:
    """The run's trainer process: started, watched, restarted while it makes progress.

    The restart policy is the stack's (:class:`flywheel.runtime.supervise.RestartBackoff`), with a new
    step as the sign of health: a trainer that trained since it last started is restarted at
    once; exits in a row without a step wait longer each time, and after
    ``MAX_RESTARTS_WITHOUT_PROGRESS`` of them the run fails (:class:`RunFailed`)."""

    def __init__(self, owner: RunOwner) -> None:
        self.owner = owner
        argv: tuple[str, ...] = ("-m", "flywheel_trainer", "--run", owner.cfg.run)
        ranks = owner.settings.trainer.ranks
        if ranks > 1:  # torch's launcher starts the ranks, and stops them all when one dies; its
            # options end at "--" (it would read --run as an abbreviation of its --run-path)
            argv = ("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
                    "flywheel_trainer", "--", *argv[2:])
        # One rank: forked from the fork server of a stack on this machine, when there is one
        # (flywheel.runtime.forkserver), torch and transformers imported already.
        spec = ServiceSpec(argv, heartbeat_of("trainer"), fork_level="torch" if ranks == 1 else None)
        settings = owner.settings.model_copy(update={"metrics_port": owner.trainer_metrics_port})
        # Its own NATS login, user trainer: never the orchestrator's.
        self.process = ServiceProcess("trainer", spec, trainer_env(settings), owner.run_dir / "trainer.log",
                                      settings.data_dir if settings.fork_services else None)
        self.backoff = RestartBackoff(Backoff(first_s=1.0, max_s=20.0), healthy_after_s=1.0)
        self.progressed_since_start = False

    async def start(self) -> None:
        await self.process.launch()
        self.progressed_since_start = False
        await self.owner.note(f"trainer pid {self.process.pid}, log {self.process.log_path}")

    def progressed(self) -> None:
        """A new step was published: this start of the trainer works."""
        self.progressed_since_start = True

    async def check(self) -> bool:
        """True once the trainer exited having finished the run; restarts it if it exited
        before; RunFailed once restarts stop helping."""
        returncode = self.process.returncode()
        if returncode is None:
            return False
        try:
            state = await get_run(self.owner.bus, self.owner.cfg.run)
        except (TimeoutError, nats.errors.Error):
            return False  # did it finish the run? asked again once the bus answers
        if returncode == 0 and state is not None and state.status == "finished":
            return True
        delay_s = self.backoff.after_exit(float("inf") if self.progressed_since_start else 0.0)
        num_failed = self.backoff.num_failures - 1  # restarts that brought no step
        if num_failed >= MAX_RESTARTS_WITHOUT_PROGRESS:
            raise RunFailed(f"the trainer exited with {exit_text(returncode)}; it was restarted {num_failed} times "
                            f"without a new step in between, giving up; {self.process.log_tail()}")
        await self.owner.note(f"the trainer (pid {self.process.pid}) exited with {exit_text(returncode)}; restarting "
                              f"it in {delay_s:g}s (restart {num_failed + 1} of at most "
                              f"{MAX_RESTARTS_WITHOUT_PROGRESS} without a new step); it resumes from its checkpoint; "
                              f"{self.process.log_tail()}")
        if await wait_set(self.owner.stopping, delay_s):
            return False
        await self.start()
        return False

    async def stop(self) -> None:
        await self.process.stop(TRAINER_STOP_S)


class RunOwner:
    """Owns one claimed run until it ends, is stopped, or is lost to another owner."""

    def __init__(self, bus: Bus, settings: Settings, state: events.RunState, name: str, pool: WorkerPool,
                 metrics_slot: int = 0) -> None:
        """``pool``: the environment workers its task sets and evals run in."""
        self.bus = bus
        self.settings = settings
        self.pool = pool
        # Where its trainer serves its Prometheus figures: TRAINER_METRICS_OFFSET + the lowest slot
        # free among the orchestrator's runs past the orchestrator's own port (0: a free port).
        self.metrics_slot = metrics_slot
        self.trainer_metrics_port = (None if settings.metrics_port is None else
                                     settings.metrics_port and settings.metrics_port + TRAINER_METRICS_OFFSET
                                     + metrics_slot)
        self.name = name  # the owner's name in the run state: the orchestrator instance
        # A config registered over HTTP is its tenant's: it names no import path, trusted or not.
        self.prepared = state.prepared
        self.cfg = RunConfig.parse(state.config, source=f"run {state.id!r} config",
                                   trusted_modules=settings.trusted_modules if state.prepared else ())
        self.tenant = state.tenant  # the run's owner, whose are its eval runs too
        self.run_dir = run_folder(settings.data_dir.resolve(), state.id)
        self.stopping = asyncio.Event()  # set by the orchestrator when it stops
        self.environments: dict[str, RunEnvironment] = {}  # by name in subjects, in the config's order
        self.rows: list[list[dict[str, Any]]] = []  # each environment's task rows, loaded as needed
        self.num_published = state.num_tasks_published
        # Tasks published before this owner were released by inference (the run had ended or
        # lost its owner): the supply counts what the run still needs from here.
        self.first_task = state.num_tasks_published
        self.first_step = state.trainer_step
        self.trainer_step = state.trainer_step  # the newest step a weight update announced
        self.last_step_at = time.monotonic()  # when that step came (or this owner started)
        self.unused_before = 0  # untrained groups counted before the supply last started again (a reissue)
        self._reissued_stall = False  # tasks were reissued in the present stall (once a stall)
        self.lease_expires_at = state.lease_expires_at  # as this owner last renewed it
        self.lease_lapsed_at: datetime | None = None  # a lapse found at a renewal, until tasks are reissued
        self.paused = state.status == "paused"  # its trainer is stopped until the run is resumed
        self.num_unused = 0  # rollouts of the groups the trainer consumed untrained (each weight update says)
        self._said_bad_count = False  # a weight update counted more drops than rollouts published (said once)
        self._drops_step: int | None = None  # the step of the last update whose drop count was read
        self._said_foreign = False  # a weight update not of the run's trainer was ignored (said once)
        self.progress = Progress()
        self._supplying = asyncio.Lock()
        self.evals_path = self.run_dir / "evals.jsonl"
        self._evals: asyncio.Queue[tuple[int, int]] = asyncio.Queue()  # (step, version) whose evals are due
        self._evals_queued: set[int] = set()  # versions queued so far
        self._evals_due = 0  # steps queued whose evals are not done

    async def note(self, text: str) -> None:
        log.info("run %s: %s", self.cfg.run, text)
        try:
            await add_note(self.bus, self.cfg.run, text)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("run %s: could not add a note (%s: %s)", self.cfg.run, type(exc).__name__, exc)

    async def run(self) -> None:
        """Own the run until it ends or this owner stops or loses it."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
        trainer: TrainerSupervisor | None = None
        lost = asyncio.Event()
        lease = asyncio.ensure_future(self._renew_lease(lost))
        ending: dict[str, Any] | None = None  # the state's end, when this owner ends the run
        evaluating: asyncio.Future[None] | None = None
        try:
            if not self.prepared:
                prepared = await self._prepare()
                if prepared is None:
                    lost.set()
                    return
                cfg = prepared
            if self.first_step or self.first_task:
                await self.note(f"taken over by {self.name} at step {self.first_step} of {cfg.trainer.num_steps}")
            await self._wait_for_previous_trainer()
            trainer = TrainerSupervisor(self)
            if self.paused:
                await self.note(f"{self.name} holds the run paused; `flywheel runs resume {cfg.run}` goes on")
            else:
                # First: the trainer's start-up (imports, the model, version 0) is the run's longest
                # wait, and it loads the environments itself.
                await trainer.start()
            self.environments = await load_run_environments(self.pool, cfg, self.tenant)
            self.rows = [[] for _ in self.environments]
            scorers, env_scorers = reward_definition(cfg, self.environments)
            await update_run(self.bus, cfg.run, scorers=scorers, env_scorers=env_scorers,
                             env_ids=config_ids(self.environments))
            await self._publish_tasks()
            if cfg.evals:
                evaluating = asyncio.ensure_future(self._run_evals())
                await self._queue_pinned_evals()  # left by an owner before this one
            ending = await self._follow(trainer, lost)
            if ending is None and not lost.is_set() and not self.stopping.is_set() and cfg.evals:
                await self._finish_evals(evaluating)
        except RunFailed as exc:
            reason = str(exc).split("; last lines of", 1)[0]
            await self.note(f"failed: {exc}")
            ending = {"status": "failed", "ended_at": events.utc_now(), "reason": reason}
        except (TimeoutError, nats.errors.Error) as exc:  # the bus is away: released, to be claimed again
            log.warning("run %s: the bus failed its owner (%s: %s); releasing it", cfg.run, type(exc).__name__, exc)
        except Exception as exc:  # the run cannot go on (its environment does not load, ...): it fails, saying why
            log.exception("run %s: its owner failed", cfg.run)
            reason = f"{self.name} could not run it: {type(exc).__name__}: {exc}"
            await self.note(f"failed: {reason}")
            ending = {"status": "failed", "ended_at": events.utc_now(), "reason": reason}
        finally:
            if trainer is not None:
                await trainer.stop()
            if evaluating is not None:
                evaluating.cancel()
                await asyncio.gather(evaluating, return_exceptions=True)
            lease.cancel()
            await asyncio.gather(lease, return_exceptions=True)
            await self._end(ending, lost.is_set())

    async def _prepare(self) -> RunConfig | None:
        """A run registered over HTTP: its environments loaded in this orchestrator's workers, its
        hub environments pinned and installed, its config written as registered (as ``flywheel
        run`` registers one); None when another owner took the run meanwhile. What does not load
        raises, and the run fails saying why."""
        await self.note(f"{self.name} loads its environments ({', '.join(e.id for e in self.cfg.environments)})")
        cfg, environments = await prepare_run(self.pool, self.cfg, self.settings.resolved_gateway_url, self.tenant)
        scorers, env_scorers = reward_definition(cfg, environments)
        state = await prepared_run(self.bus, cfg.run, self.name, cfg.model_dump(), scorers, env_scorers,
                                   config_ids(environments))
        if state is None:
            return None
        self.cfg, self.prepared = cfg, True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
        for name, found in environments.items():
            await self.note(f"{name}: {describe_reward(env_scorers.get(name, scorers), found.env)}")
        return cfg

    async def _wait_for_previous_trainer(self) -> None:
        """Until no other trainer of this run lives: a run taken over from a dead owner may still
        have the trainer that owner started, checkpointing on its way out. Its heartbeat says so;
        one of this host whose process is gone does not count; at most until a heartbeat would
        have expired (then the run goes on, and says so)."""
        deadline = time.monotonic() + SERVICE_HEARTBEAT_TTL_S + 5.0
        said = False
        while not self.stopping.is_set():
            others = [b for b in await read_heartbeats(self.bus)
                      if b.service == "trainer" and b.info.get("run") == self.cfg.run and not _process_gone(b)]
            if not others:
                return
            if time.monotonic() > deadline:
                await self.note(f"a trainer of the run (pid {others[0].pid} on {others[0].host}) still beats after "
                                f"{SERVICE_HEARTBEAT_TTL_S + 5.0:g}s; starting this owner's trainer anyway")
                return
            if not said:
                await self.note(f"waiting for the run's previous trainer (pid {others[0].pid} on {others[0].host}) "
                                "to stop before starting another")
                said = True
            await asyncio.sleep(0.5)

    async def _end(self, ending: dict[str, Any] | None, lost: bool) -> None:
        """Write the run's summary (it ended, or stopped) and let go of the run, unless another
        owner has it."""
        if lost:
            return
        try:
            state = await get_run(self.bus, self.cfg.run)
            ended = ending is not None or (state is not None and state.status in ("finished", "stopped", "failed"))
            if ended:
                self._write_summary()
            await release_run(self.bus, self.cfg.run, self.name, **(ending or {}))
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("run %s: could not release the run (%s: %s); its lease expires within %gs", self.cfg.run,
                        type(exc).__name__, exc, self.settings.run_lease_s)

    def _write_summary(self) -> None:
        """``summary.json`` and ``reward.png`` from the trainer's ``metrics.jsonl``."""
        progress = Progress()
        metrics = self.run_dir / "metrics.jsonl"
        first_time: float | None = None
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                row = json.loads(line)
                stamp = _timestamp(row.get("time"))
                if not row.get("step"):
                    first_time = stamp if stamp is not None else first_time
                    continue
                elapsed = stamp - first_time if stamp is not None and first_time is not None else 0.0
                progress.steps.append({"step": float(row["step"]), "elapsed_s": elapsed,
                                       **{k: v for k, v in row.items() if isinstance(v, int | float)}})
        scorers = reward_definition(self.cfg, self.environments)[0] if self.environments else {}
        names = [name for name, weight in scorers.items() if not weight]
        summary = summarize(progress, self.cfg, self.run_dir, names)
        evals = _read_jsonl(self.evals_path)
        for spec in self.cfg.evals:
            points = sorted((row["step"], row["reward_mean"]) for row in evals if row["eval"] == spec.label)
            if points:
                summary[f"eval.{spec.label}.first"] = points[0][1]
                summary[f"eval.{spec.label}.last"] = points[-1][1]
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot(progress, self.run_dir / "reward.png", f"{self.cfg.run}: {self.cfg.env_ids}, {self.cfg.model.name}",
             evals)

    async def _follow(self, trainer: TrainerSupervisor, lost: asyncio.Event) -> dict[str, Any] | None:
        """Until the run ends (None: the trainer wrote its end) or is stopped, lost, or this owner
        stops (None). Restarts the trainer, replaces dropped rollouts with tasks."""
        updates: asyncio.Queue[events.WeightUpdate] = asyncio.Queue()
        watching = asyncio.ensure_future(self._watch_weights(updates))
        last_state_s = last_reconcile_s = time.monotonic()
        try:
            while not self.stopping.is_set() and not lost.is_set():
                if self.lease_lapsed_at is not None and not self.paused:
                    lapsed_at, self.lease_lapsed_at = self.lease_lapsed_at, None
                    await self._reissue(f"the run's lease lapsed at {lapsed_at.isoformat(timespec='seconds')} "
                                        "before its owner could renew it (the bus refused writes?): inference "
                                        "released the tasks it held")
                if not self.paused and time.monotonic() - last_reconcile_s > RECONCILE_S:
                    last_reconcile_s = time.monotonic()
                    try:
                        await self._reconcile()
                    except (TimeoutError, nats.errors.Error) as exc:  # the bus away: compared again later
                        log.warning("run %s: comparing its tasks with the TASKS stream failed (%s: %s)",
                                    self.cfg.run, type(exc).__name__, exc)
                if not self.paused and await trainer.check():
                    return None  # it finished the run and marked it so
                if watching.done():
                    await watching  # raises what ended the watch
                if time.monotonic() - last_state_s > STATE_CHECK_S:
                    last_state_s = time.monotonic()
                    try:
                        state = await get_run(self.bus, self.cfg.run)
                    except (TimeoutError, nats.errors.Error) as exc:  # the server restarting: the trainer goes on
                        log.warning("run %s: reading its state failed (%s: %s); trying again", self.cfg.run,
                                    type(exc).__name__, exc)
                        state = None
                    if state is not None and state.status in ("stopped", "failed"):  # by someone else
                        await self.note(f"{state.reason or 'stopped'}: stopping the trainer (it checkpoints first)")
                        return None
                    if state is not None and (state.status == "paused") != self.paused:
                        await self._pause_or_go_on(trainer, state)
                    if state is not None and state.owner != self.name:
                        lost.set()
                        break
                update = await wait_at_most(updates.get(), 0.5)
                if update is None:
                    continue
                foreign = self.cfg.foreign_step(update.trainer_step)
                if foreign is not None:
                    if not self._said_foreign:
                        await self.note(foreign)
                        self._said_foreign = True
                    continue
                if self.progress.add(update) is not None:
                    trainer.progressed()
                if update.trainer_step > self.trainer_step:
                    self.trainer_step, self.last_step_at = update.trainer_step, time.monotonic()
                    self._reissued_stall = False
                self._queue_evals(update.trainer_step, update.version)
                try:
                    await self._publish_tasks(update.num_unused_total, update.trainer_step)
                except (TimeoutError, nats.errors.Error) as exc:  # published with the next update instead
                    log.warning("run %s: publishing tasks failed (%s: %s)", self.cfg.run, type(exc).__name__, exc)
            return None
        finally:
            # Its unsubscribe is a request to the bus: bounded, so a busy or restarting server
            # never holds the run's release (the owner lets go after this).
            watching.cancel()
            done, _ = await asyncio.wait([watching], timeout=WATCH_END_S)
            if not done:
                log.warning("run %s: the watch of its weights did not end within %gs; going on without it",
                            self.cfg.run, WATCH_END_S)

    async def _pause_or_go_on(self, trainer: TrainerSupervisor, state: events.RunState) -> None:
        """The run was paused (stop the trainer; it checkpoints first) or resumed (start it again:
        it goes on from that checkpoint)."""
        self.paused = state.status == "paused"
        if self.paused:
            await self.note(f"{state.reason or 'paused'}: stopping the trainer (it checkpoints first); the run "
                            f"keeps its tasks; `flywheel runs resume {self.cfg.run}` goes on")
            await trainer.stop()
            await self.note("paused")
        else:
            await self.note("resumed: starting the trainer again")
            await trainer.start()

    # --- evals -------------------------------------------------------------------------------

    def _queue_evals(self, step: int, version: int) -> None:
        if self.cfg.evals_at(step) and version not in self._evals_queued:
            self._evals_queued.add(version)
            self._evals_due += 1
            self._evals.put_nowait((step, version))

    async def _queue_pinned_evals(self) -> None:
        """Queue the evals of the weights the run keeps pinned (their evals are not done)."""
        state = await get_run(self.bus, self.cfg.run)
        pinned = set(state.pinned_versions) - self._evals_queued if state is not None else set()
        if not pinned:
            return
        for update in await weights.updates(self.bus, self.cfg.run):
            # A version a teacher serves is pinned for the run's life, with or without evals.
            if update.version in pinned and self.cfg.evals_at(update.trainer_step):
                self._queue_evals(update.trainer_step, update.version)

    async def _finish_evals(self, evaluating: asyncio.Future[None] | None) -> None:
        """The trainer finished: run the evals still due (the last step's among them), then drop
        the weight versions kept only for evals."""
        await self._queue_pinned_evals()
        if self._evals_due:
            await self.note(f"training finished; the evals of {self._evals_due} more step(s) come before the summary")
            join = asyncio.ensure_future(self._evals.join())
            assert evaluating is not None
            await asyncio.wait([join, evaluating], return_when=asyncio.FIRST_COMPLETED)
            join.cancel()
        # The trainer has gone: the versions it kept only for evals (those done after its last
        # purge included) or for its teachers are dropped here, as it would have dropped them
        # with a later version.
        for version in self.cfg.teacher_versions:
            await unpin_version(self.bus, self.cfg.run, version)
        folder = self.settings.trainer.weights_dir
        kept = await weights.versions(self.bus, self.cfg.run, folder)
        state = await get_run(self.bus, self.cfg.run)
        if kept and state is not None:
            newest = kept[-self.settings.trainer.weight_versions_kept:]
            for version in kept:
                if version not in newest and version not in state.pinned_versions:
                    await weights.delete(self.bus, self.cfg.run, version, folder)

    async def _run_evals(self) -> None:
        """The run's evals, one step at a time, as they are queued; a pinned version is let go
        once its evals are done (or failed, said in a note)."""
        done = {(row["eval"], row["step"]) for row in _read_jsonl(self.evals_path)}
        while True:
            step, version = await self._evals.get()
            try:
                for spec in self.cfg.evals_at(step):
                    if (spec.label, step) not in done:
                        await self._eval(spec, step)
                        done.add((spec.label, step))
                if version not in self.cfg.teacher_versions:  # a teacher's stays pinned until the run's end
                    await unpin_version(self.bus, self.cfg.run, version)
            except (TimeoutError, nats.errors.Error) as exc:  # the bus is away: the pin stays for a later owner
                log.warning("run %s: evals of step %d: %s: %s", self.cfg.run, step, type(exc).__name__, exc)
            finally:
                self._evals_due -= 1
                self._evals.task_done()

    async def _eval(self, spec: EvalSpec, step: int) -> None:
        cfg = self.cfg
        run_id = f"{cfg.run}-eval-{spec.label}-{step}"
        settings = self.settings
        eval_cfg = EvalConfig(env=spec.id, model=f"{cfg.run}@{step}", base_url=settings.resolved_inference_url,
                              api_key=settings.service_token,
                              out=self.run_dir / "evals" / f"{spec.label}-{step}.jsonl",
                              num_tasks=spec.num_tasks, num_rollouts=spec.num_rollouts, resume=True,
                              env_args=dict(spec.args), seed=spec.seed, record=True, run_id=run_id,
                              tenant=self.tenant,
                              sampling=cfg.eval_sampling(spec),
                              during={"train_run": cfg.run, "step": step, "name": spec.label})
        try:
            summary = await run_eval(eval_cfg, settings.resolved_nats_url, progress_out=io.StringIO(), pool=self.pool)
        except Exception as exc:  # the environment does not load, inference refuses, ...: said, training goes on
            log.exception("run %s: eval %s of step %d failed", cfg.run, spec.label, step)
            await self.note(f"eval {spec.label} of step {step} failed: {type(exc).__name__}: {exc}")
            return
        row = {"eval": spec.label, "step": step, "run": run_id, **{k: summary.get(k) for k in EVAL_FIGURES}}
        with self.evals_path.open("a") as out:
            out.write(json.dumps(row) + "\n")
        await add_eval_point(self.bus, cfg.run, events.EvalPoint(
            eval=spec.label, step=step, run=run_id, reward_mean=summary.get("reward_mean"),
            reward_stderr=summary.get("reward_stderr"), num_rollouts=summary.get("num_rollouts") or 0,
            num_errors=summary.get("num_errors") or 0))
        stderr = f" ± {summary['reward_stderr']:.3f}" if summary.get("reward_stderr") is not None else ""
        mean = f"{summary['reward_mean']:.3f}" if summary.get("reward_mean") is not None else "none"
        await self.note(f"eval {spec.label} of step {step}: reward {mean}{stderr} over {summary['num_rollouts']} "
                        f"rollouts, {summary['num_errors']} errors (eval run {run_id})")

    async def _watch_weights(self, out: asyncio.Queue[events.WeightUpdate]) -> None:
        never = asyncio.Event()  # the watch ends when this task is cancelled
        async for update in watch(self.bus, f"weights.{self.cfg.run}", events.WeightUpdate, never,
                                  watcher="orchestrator-weights", last_per_subject=True):
            await out.put(update)

    async def _renew_lease(self, lost: asyncio.Event) -> None:
        """Keep the lease: renewed every third of run_lease_s, sooner after a failed renewal. A
        renewal that finds another owner sets ``lost``."""
        period_s = self.settings.run_lease_s / 3
        while True:
            await asyncio.sleep(period_s)
            lapsed = self.lease_expires_at is not None and events.utc_now() > self.lease_expires_at
            try:
                renewed = await renew_lease(self.bus, self.cfg.run, self.name, self.settings.run_lease_s)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("run %s: renewing the lease failed (%s: %s); retrying", self.cfg.run,
                            type(exc).__name__, exc)
                period_s = min(5.0, self.settings.run_lease_s / 6)
                continue
            if renewed is None:
                log.warning("run %s: another owner holds the run now; letting go of it", self.cfg.run)
                lost.set()
                return
            if lapsed:  # inference may have released the tasks it held meanwhile (the run looked abandoned)
                self.lease_lapsed_at = self.lease_expires_at
            self.lease_expires_at = renewed.lease_expires_at
            period_s = self.settings.run_lease_s / 3

    async def _publish_tasks(self, num_unused: int | None = None, trainer_step: int = 0) -> None:
        """Publish tasks up to what the run needs; called again as groups are lost (``num_unused``:
        the rollouts of the groups the trainer consumed with nothing trained, as the update of
        ``trainer_step`` counts them; a group that trained some of its rollouts needs no other)."""
        async with self._supplying:
            if num_unused is not None:
                # Bounded here, where it is read, so that a forged or corrupt update cannot flood the
                # supply (said once): never past every rollout published so far, and, from one
                # update to the next, never more than inference could issue past the trainer in
                # between (the staleness bound's rollouts for each step since).
                cfg = self.cfg
                most = self.num_published * cfg.group_size
                if self._drops_step is not None:
                    steps = max(1, trainer_step - self._drops_step) + cfg.trainer.max_off_policy_steps + 1
                    most = min(most, self.num_unused + steps * cfg.trainer.batch_size)
                self._drops_step = max(self._drops_step or 0, trainer_step)
                if num_unused > most:
                    if not self._said_bad_count:
                        await self.note(f"a weight update of step {trainer_step} says {num_unused} rollouts were "
                                        f"consumed untrained, more than could have been ({most}): counted as {most}")
                        self._said_bad_count = True
                    num_unused = most
                self.num_unused = max(self.num_unused, num_unused)
            await self._publish_more()

    async def _reconcile(self) -> None:
        """Compare what the owner believes published with what the bus holds, and publish what
        the run still needs when its tasks are gone: the TASKS stream holds none of the run's
        (purged, deleted: once, since the stream then holds the new ones), or no task of the run
        waits or is being rolled out while no step came for ``STALL_S`` (once a stall: a new
        step ends it). Tasks published again are new positions, so new tasks and new rollouts:
        nothing is trained twice."""
        if not self.num_published:
            return
        cfg = self.cfg
        held = await self.bus.js.stream_info("TASKS", subjects_filter=f"tasks.{cfg.run}.>")
        if not sum((held.state.subjects or {}).values()):
            await self._reissue(f"the TASKS stream holds none of the {self.num_published} tasks published "
                                "(purged or deleted)")
            return
        if self._reissued_stall or time.monotonic() - self.last_step_at < STALL_S:
            return
        try:
            consumer = await self.bus.js.consumer_info("TASKS", task_durable(cfg.run))
        except nats.js.errors.NotFoundError:
            return  # no inference consumes the run's tasks yet (or it makes its consumer again)
        if consumer.num_pending or consumer.num_ack_pending:
            return
        self._reissued_stall = True
        await self._reissue(f"no step for {time.monotonic() - self.last_step_at:.0f}s and no task of the run waits "
                            "in TASKS or is being rolled out (tasks lost?)")

    async def _reissue(self, why: str) -> None:
        """Publish tasks for the steps left, as an owner that claims the run does."""
        async with self._supplying:
            self.first_task, self.first_step = self.num_published, self.trainer_step
            self.unused_before = self.num_unused
            await self.note(f"{why}: publishing tasks for the {self.cfg.trainer.num_steps - self.trainer_step} "
                            "steps left")
            await self._publish_more()

    async def _publish_more(self) -> None:
        cfg, num_unused = self.cfg, self.num_unused - self.unused_before
        if cfg.num_tasks is not None:
            wanted = max(cfg.num_tasks, self.num_published) if self.first_task == 0 else (
                self.first_task + cfg.num_tasks)
        else:
            steps_left = cfg.trainer.num_steps - (self.first_step if self.first_task else 0)
            wanted = (self.first_task + (steps_left + cfg.trainer.max_off_policy_steps + 2) * cfg.groups_per_step
                      + -(-num_unused // cfg.group_size))
        if wanted <= self.num_published:
            return
        tasks = await self._tasks(self.num_published, wanted)
        try:
            await self.bus.publish_many(tasks)  # none is sent when one does not fit
        except PayloadTooLarge as exc:  # a row no retry makes smaller: the run cannot have it
            raise RunFailed(f"{exc}: a task row of its environment is too large for the bus; make the rows smaller "
                            "(a reference to large data instead of the data) or raise the NATS server's "
                            "max_payload") from exc
        if self.num_published == 0:
            shares = Counter(task.env for task in tasks)
            mix = ", ".join(f"{name} {shares[name]}" for name in self.environments) if len(shares) > 1 else cfg.env_ids
            text = (f"published {len(tasks)} tasks of {cfg.group_size} rollouts each ({mix}); "
                    f"{cfg.trainer.num_steps} steps of {cfg.trainer.batch_size} rollouts")
        elif self.num_published == self.first_task:
            text = f"published {len(tasks)} tasks for the {cfg.trainer.num_steps - self.first_step} steps left"
        else:
            text = f"published {len(tasks)} more tasks to replace groups that trained nothing (all dropped)"
        self.num_published = wanted
        await update_run(self.bus, cfg.run, num_tasks_published=wanted)
        await self.note(text)

    async def _tasks(self, start: int, end: int) -> list[events.Task]:
        """The run's tasks at positions ``start`` to ``end`` (from 0, end excluded): the
        schedule says each one's environment, whose next row it takes (rows are loaded, twice
        what is needed, as the supply grows)."""
        cfg = self.cfg
        schedule = cfg.env_schedule(end)
        envs = list(self.environments.values())
        for i, found in enumerate(envs):
            needed = schedule.count(i)
            if len(self.rows[i]) < needed:
                self.rows[i] = await found.env.load_tasks(2 * needed, seed=cfg.task_seed)
        seen = [0] * len(envs)
        tasks = []
        for position, i in enumerate(schedule):
            row = self.rows[i][seen[i]]
            seen[i] += 1
            if position < start:
                continue
            tasks += make_tasks(cfg.run, envs[i].name, [(position + 1, row)], num_rollouts=cfg.group_size,
                                sampling=cfg.task_sampling(position, envs[i].config))
        return tasks


def _process_gone(beat: events.ServiceHeartbeat) -> bool:
    """Whether ``beat`` is of a process of this host that no longer runs (its heartbeat lingers
    until it expires)."""
    if beat.host != socket.gethostname():
        return False
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file the owner appends to; none when it does not exist; a torn last
    line (an owner killed mid-write) is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _timestamp(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None
