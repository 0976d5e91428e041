"""``flywheel run CONFIG.toml``: the main job, a training run from one command.

What it does, in order:

1. validates the run config (:class:`flywheel.contract.config.RunConfig`) and gives the run a
   fresh id (``<run>-<UTC time>``, or ``--run-id``);
2. uses the services that run (``flywheel up`` in another terminal, or a deployment), or,
   when no NATS answers, brings up the embedded stack itself and stops it at the end;
3. registers the run with its config in the run-state bucket (every service reads it from
   there) and becomes its *owner*: it holds a lease on the run (``RunState.lease_expires_at``,
   renewed every third of ``run_lease_s``), so that when this process dies the run is seen
   as abandoned once the lease expires (:func:`flywheel.contract.runs.end_of`) and its queued tasks
   stop holding inference;
4. starts a trainer for it (``python -m flywheel_trainer --run RUN``; it warms the model up
   with SFT when the config asks, then publishes weights version 0) and keeps it running: a
   trainer that dies is started again with backoff and resumes from its checkpoint and
   journal; after ``MAX_RESTARTS_WITHOUT_PROGRESS`` restarts without a new step in
   between, the run is marked ``failed`` with the reason;
5. publishes the environment's tasks (the task supply; their count is kept in the run
   state, so a resumed run goes on from there); inference admits them as fast as the
   staleness bound allows;
6. follows the trainer's weight updates (each carries its step's metrics, and the rollouts
   dropped so far, ``num_dropped_total``, for which it publishes replacement tasks) and
   prints a line a step: reward, staleness, tokens/s, rollouts in flight; when no step
   comes for a while it says what it waits for;
7. at the end prints a summary table and writes ``reward.png`` and ``summary.json`` in the
   run folder (``<data_dir>/runs/<run>``), beside the trainer's ``metrics.jsonl``.

Ctrl-C stops the trainer (it checkpoints first) and marks the run ``stopped`` (and stops the
stack, if this command started it); a run marked ``stopped`` by someone else (``flywheel runs
stop``, ``POST /v1/runs/RUN/stop``) is seen within ``STATE_CHECK_S`` and stopped the same
way. ``--resume`` takes over the run ``--run-id`` names (without it: the config's own
``run``, no time added) instead of refusing an existing id: same config required, the
trainer resumes from its checkpoint, and tasks are published again where the run's queued
ones were dropped (it was stopped or abandoned). A run owned by a live process on another
machine is waited for until its lease expires. Not covered: several owners of one run at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import nats.errors
import nats.js.errors

from flywheel.contract import events
from flywheel.contract.bus import Bus, BusConfig, watch
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import end_of, get_run, register_run, update_run
from flywheel.contract.service import read_heartbeats
from flywheel.contract.settings import Settings
from flywheel.ops.client import make_tasks
from flywheel.ops.stack import (
    SERVICES,
    RestartBackoff,
    ServiceProcess,
    ServiceSpec,
    Stack,
    StackError,
    child_env,
    exit_text,
    heartbeat_of,
    wait_set,
)
from flywheel.sdk.environment import Environment, load_for_run, subject_name
from flywheel.sdk.scoring import describe_reward, required_scorers

RUN_SERVICES = ("inference", "scorer")  # what a training run needs besides the trainer
MAX_RESTARTS_WITHOUT_PROGRESS = 5  # trainer restarts with no new step in between before the run fails
QUIET_STEP_S = 30.0  # no step for this long: say what the run waits for
STOP_TIMEOUT_S = 60.0  # a run stopping because its embedded stack failed gets this long, bus still up
NUM_LETTERS_SAID = 5  # dead letters of the run said one by one; after these, a count now and then
STATE_CHECK_S = 2.0  # how often the owner reads its run's state (a stop asked by someone else)


@dataclass
class Progress:
    """What the run printed so far; the summary and the plot are made from it."""

    started_s: float = field(default_factory=time.monotonic)
    steps: list[dict[str, float]] = field(default_factory=list)

    def add(self, update: events.WeightUpdate) -> dict[str, float] | None:
        if update.trainer_step == 0 or any(s["step"] == update.trainer_step for s in self.steps):
            return None
        row = {"step": float(update.trainer_step), "elapsed_s": time.monotonic() - self.started_s, **update.metrics}
        self.steps.append(row)
        return row


DROP_REASONS = {"stale": "stale", "scorer_error": "scorer error", "rollout_error": "rollout error"}


def format_dropped(row: dict[str, float]) -> str:
    """Rollouts dropped, with the reasons that count: ``3 (stale 1, scorer error 2)``."""
    by_reason = {label: int(row.get(f"num_dropped_{key}", 0.0)) for key, label in DROP_REASONS.items()}
    total = sum(by_reason.values())
    reasons = ", ".join(f"{label} {n}" for label, n in by_reason.items() if n)
    return f"{total} ({reasons})" if reasons else str(total)


def format_step(row: dict[str, float], num_steps: int, in_flight: int | None, metrics: Sequence[str] = ()) -> str:
    """One step's line; ``metrics``: the scorers of weight 0, shown by their step mean."""
    def get(key: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(row[key]) if key in row else "-"

    shown = "".join(f"  {name} {get(f'scores.{name}')}" for name in metrics)
    return (f"step {int(row['step']):>3}/{num_steps}  reward {get('reward_mean')}{shown}  "
            f"staleness {get('staleness_mean', '{:.2f}')} (max {get('staleness_max', '{:.0f}')})  "
            f"dropped {format_dropped(row)}  tokens/s {get('tokens_per_s', '{:.0f}')}  "
            f"in flight {in_flight if in_flight is not None else '-'}  t {row['elapsed_s']:.1f}s")


def summarize(progress: Progress, cfg: RunConfig, run_dir: Path, metrics: Sequence[str] = ()) -> dict[str, Any]:
    """The run's figures; ``metrics`` (the scorers of weight 0) by their mean over the first and
    the last quarter of the steps, as the reward is."""
    rewards = [s["reward_mean"] for s in progress.steps if "reward_mean" in s]
    k = max(1, len(rewards) // 4)
    first, last = rewards[:k], rewards[-k:]
    quarters: dict[str, float | None] = {}
    for name in metrics:
        values = [s[f"scores.{name}"] for s in progress.steps if f"scores.{name}" in s]
        quarters[f"{name}_first"] = sum(values[:k]) / len(values[:k]) if values else None
        quarters[f"{name}_last"] = sum(values[-k:]) / len(values[-k:]) if values else None
    dropped = {f"num_dropped_{key}": sum(s.get(f"num_dropped_{key}", 0.0) for s in progress.steps)
               for key in DROP_REASONS}
    return {
        "run": cfg.run,
        "env": cfg.env,
        "model": cfg.model.name,
        "steps": len(progress.steps),
        "elapsed_s": progress.steps[-1]["elapsed_s"] if progress.steps else 0.0,
        "reward_first": sum(first) / len(first) if first else None,
        "reward_last": sum(last) / len(last) if last else None,
        "reward_gain": (sum(last) / len(last) - sum(first) / len(first)) if rewards else None,
        "window_steps": k,
        **quarters,
        **dropped,
        "staleness_max": max((s.get("staleness_max", 0.0) for s in progress.steps), default=0.0),
        "tokens_per_s_mean": (sum(s.get("tokens_per_s", 0.0) for s in progress.steps) / len(progress.steps)
                              if progress.steps else 0.0),
        "run_dir": str(run_dir),
    }


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    width = max(len(k) for k in summary)
    return "\n".join(f"  {k.ljust(width)}  {fmt(v)}" for k, v in summary.items())


def plot(progress: Progress, path: Path, title: str) -> Path | None:
    """The reward curve as a PNG; None when matplotlib (the ``run`` extra) is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in progress.steps if "reward_mean" in s]
    rewards = [s["reward_mean"] for s in progress.steps if "reward_mean" in s]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker="o", markersize=3)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


async def nats_answers(url: str) -> bool:
    # A refused TCP connection answers at once; the NATS client's own connect waits out its timeout.
    parsed = urlsplit(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parsed.hostname or "127.0.0.1", parsed.port or 4222),
                                           1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        bus = await Bus.connect(url, "flywheel-run-probe", BusConfig(connect_timeout_s=1.0), ensure=False)
    except ConnectionError:
        return False
    await bus.close()
    return True


class RunFailed(StackError):
    """The run cannot go on (its trainer keeps failing); the run state says ``failed`` with the reason."""


def owner_name() -> str:
    return f"flywheel-run pid {os.getpid()} on {socket.gethostname()}"


def owner_is_gone(owner: str | None) -> bool:
    """Whether ``owner`` (an :func:`owner_name`) is known to be dead: a process of this host
    that no longer runs, or this very process id (a restarted container is pid 1 again)."""
    if not owner or not owner.startswith("flywheel-run pid "):
        return False
    pid_text, _, host = owner.removeprefix("flywheel-run pid ").partition(" on ")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class TrainerSupervisor:
    """The run's trainer process: started, watched, restarted while it makes progress.

    The restart policy is the stack's (:class:`flywheel.ops.stack.RestartBackoff`), with a new
    step as the sign of health: a trainer that trained since it last started is restarted at
    once; exits in a row without a step wait longer each time, and after
    ``MAX_RESTARTS_WITHOUT_PROGRESS`` of them the run fails (:class:`RunFailed`)."""

    def __init__(self, job: MainJob) -> None:
        self.job = job
        cfg = job.cfg
        spec = ServiceSpec(("-m", "flywheel_trainer", "--run", cfg.run), heartbeat_of("trainer"))
        self.process = ServiceProcess("trainer", spec, child_env(job.settings), job.run_dir / "trainer.log")
        self.backoff = RestartBackoff(first_delay_s=1.0, max_delay_s=20.0, healthy_after_s=1.0)
        self.progressed_since_start = False

    async def start(self) -> None:
        await self.process.launch()
        self.progressed_since_start = False
        self.job.say(f"run {self.job.cfg.run}: trainer pid {self.process.pid}, log {self.process.log_path}")

    def progressed(self) -> None:
        """A new step was published: this start of the trainer works."""
        self.progressed_since_start = True

    async def check(self) -> None:
        """Restart the trainer if it exited before the run ended; RunFailed once restarts stop helping."""
        returncode = self.process.returncode()
        if returncode is None:
            return
        state = await get_run(self.job.bus, self.job.cfg.run)
        if returncode == 0 and state is not None and state.status == "finished":
            return  # it finished the run; the weights watch sees the last step
        delay_s = self.backoff.after_exit(float("inf") if self.progressed_since_start else 0.0)
        num_failed = self.backoff.num_failures - 1  # restarts that brought no step
        if num_failed >= MAX_RESTARTS_WITHOUT_PROGRESS:
            raise RunFailed(f"the trainer exited with {exit_text(returncode)}; it was restarted {num_failed} times "
                            f"without a new step in between, giving up; {self.process.log_tail()}")
        self.job.say(f"run {self.job.cfg.run}: the trainer (pid {self.process.pid}) exited with "
                     f"{exit_text(returncode)}; restarting it in {delay_s:g}s (restart {num_failed + 1} of at most "
                     f"{MAX_RESTARTS_WITHOUT_PROGRESS} without a new step); it resumes from its checkpoint; "
                     f"{self.process.log_tail()}")
        if await wait_set(self.job.stopping, delay_s):
            return
        await self.start()

    async def stop(self) -> None:
        await self.process.stop(15.0)


class MainJob:
    def __init__(self, cfg: RunConfig, settings: Settings, out: TextIO = sys.stdout,
                 start_timeout_s: float = 300.0, resume: bool = False) -> None:
        self.cfg = cfg
        self.settings = settings
        self.out = out
        self.start_timeout_s = start_timeout_s
        self.resume = resume
        self.run_dir = settings.data_dir.resolve() / "runs" / cfg.run
        self.stopping = asyncio.Event()
        self.failure: str | None = None  # why this process stopped the run, when it was not a signal
        self.progress = Progress()
        self.rows: list[dict[str, Any]] = []  # the environment's task rows, loaded once
        self.env: Environment | None = None  # loaded as every service loads it (load_for_run)
        self.num_published = 0  # tasks published for the run (kept in its state)
        self.first_task = 0  # where this owner's supply starts counting what the run still needs
        self.first_step = 0  # the trainer step the run was at when this owner took it
        self.num_dropped = 0  # rollouts the trainer dropped so far (each weight update says)
        self.required: dict[str, float] = {}  # the scorers of the run's reward, name -> weight
        self.started_at = events.utc_now()  # dead letters from here on are this owner's to say
        self.num_dead_letters = 0  # of the run's messages, since started_at
        self.seen_weights = False  # a weight update of the run came (version 0 at least)
        self.stopped_by_other: str | None = None  # why the run was stopped by someone else (flywheel runs stop)
        self._supplying = asyncio.Lock()
        self.owner = owner_name()
        self._bus: Bus | None = None

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, "connected in _train"
        return self._bus

    @property
    def metric_names(self) -> list[str]:
        """The scorers of the run's reward at weight 0 (an environment's metrics): shown, not trained on."""
        return [name for name, weight in self.required.items() if not weight]

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    async def run(self) -> dict[str, Any]:
        stack_task: asyncio.Task[None] | None = None
        stack: Stack | None = None
        url = self.settings.resolved_nats_url
        if not await nats_answers(url):
            self.say(f"no NATS at {url}: starting the embedded stack")
            services = {name: spec for name, spec in SERVICES.items()}
            stack = Stack(self.settings, out=self.out, services=services, start_timeout_s=self.start_timeout_s)
            stack_task = asyncio.ensure_future(stack.run())
            # The run starts as soon as the bus answers: its trainer loads the model while the
            # services start (what the run still waits for, it says).
            bus_ready = asyncio.ensure_future(stack.bus_ready.wait())
            await asyncio.wait([stack_task, bus_ready], return_when=asyncio.FIRST_COMPLETED)
            bus_ready.cancel()
            if stack_task.done():
                await stack_task  # raises StackError with the reason
                raise StackError("the embedded stack stopped before it was ready")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            if stack_task is None:
                return await self._train(check_services=True)
            assert stack is not None
            return await self._train_beside(stack, stack_task)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if stack is not None and stack_task is not None:
                stack.stopping.set()
                await stack_task

    async def _train_beside(self, stack: Stack, stack_task: asyncio.Future[None]) -> dict[str, Any]:
        """Train while the embedded stack starts and runs. A stack that fails (to start) stops
        the run first, marked failed with the stack's error, while the bus is still up."""
        train = asyncio.ensure_future(self._train(check_services=False))

        async def stop_the_run_first(failure: BaseException | None) -> None:
            if train.done():
                return
            self.failure = f"the embedded stack failed: {failure}" if failure else "the embedded stack stopped"
            self.stopping.set()
            await asyncio.wait([train], timeout=STOP_TIMEOUT_S)

        stack.before_shutdown = stop_the_run_first
        either: list[asyncio.Future[Any]] = [train, stack_task]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if stack_task.done() and not stack_task.cancelled() and stack_task.exception() is not None:
            await asyncio.gather(train, return_exceptions=True)
            await stack_task  # raises StackError with the reason
        return await train

    async def _train(self, check_services: bool) -> dict[str, Any]:
        """Register the run, start its trainer, supply its tasks and follow it to its end.
        ``check_services``: first wait (bounded) for the services of a stack this process did
        not start."""
        cfg = self.cfg
        self._bus = bus = await Bus.connect(self.settings.resolved_nats_url, "flywheel-run")
        trainer: TrainerSupervisor | None = None
        lease: asyncio.Task[None] | None = None
        outcome: tuple[str, str] | None = None  # (status, reason) to write when this owner ends the run
        try:
            # The environment's sampling settings are defaults under the config's own.
            self.env = load_for_run(cfg)
            cfg = self.cfg = cfg.with_sampling_defaults(self.env.sampling, f"environment {self.env.name!r}")
            if check_services:
                await self._check_services()
            if await self._take_over():
                summary = self._summary()
                self.say(f"run {cfg.run} has finished already; its summary:\n" + format_summary(summary))
                return summary
            lease = asyncio.ensure_future(self._renew_lease())
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
            trainer = TrainerSupervisor(self)
            await trainer.start()
            await self._publish_tasks()
            finished = await self._follow(trainer)
            if not finished and self.failure is not None:
                outcome = ("failed", self.failure)
            elif not finished and self.stopped_by_other is None:
                outcome = ("stopped", f"stopped by {self.owner} (SIGINT/SIGTERM) at step {self._last_step()}")
        except RunFailed as exc:
            outcome = ("failed", str(exc).split("; last lines of", 1)[0])
            raise
        finally:
            if trainer is not None:
                await trainer.stop()
            if lease is not None:
                lease.cancel()
                await asyncio.gather(lease, return_exceptions=True)
            if outcome is not None:
                await self._end(*outcome)
            await bus.close()
        return self._finish()

    def _summary(self) -> dict[str, Any]:
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                row = json.loads(line)
                if row.get("step"):
                    self.progress.steps.append({"step": float(row["step"]), "elapsed_s": 0.0,
                                                **{k: v for k, v in row.items() if isinstance(v, int | float)}})
        return summarize(self.progress, self.cfg, self.run_dir, self.metric_names)

    def _finish(self) -> dict[str, Any]:
        cfg = self.cfg
        summary = summarize(self.progress, cfg, self.run_dir, self.metric_names)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        png = plot(self.progress, self.run_dir / "reward.png", f"{cfg.run}: {cfg.env}, {cfg.model.name}")
        self.say("summary:\n" + format_summary(summary))
        self.say(f"reward curve: {png}" if png else "reward curve: install the `run` extra (matplotlib) for a PNG")
        return summary

    def _last_step(self) -> int:
        return int(self.progress.steps[-1]["step"]) if self.progress.steps else self.first_step

    def _lease_fields(self) -> dict[str, Any]:
        return {"owner": self.owner,
                "lease_expires_at": events.utc_now() + timedelta(seconds=self.settings.run_lease_s)}

    async def _take_over(self) -> bool:
        """Register the run as its owner, or with ``resume`` take over the existing one.
        True when there is nothing to do (the resumed run had finished)."""
        cfg = self.cfg
        config = cfg.model_dump()
        assert self.env is not None
        scorers = required_scorers(cfg, self.env)  # the run's reward, for the trace store (the trainer's too)
        self.required = scorers
        self.say(f"run {cfg.run}: {describe_reward(scorers, self.env)}")
        state, created = await register_run(self.bus, cfg.run, cfg.tenant, config=config, scorers=scorers)
        if created:
            await update_run(self.bus, cfg.run, **self._lease_fields())
            return False
        if not self.resume:
            raise ValueError(f"run {cfg.run!r} exists already; give another --run-id, or add --resume to take it "
                             "over and go on where it stopped")
        if state.config != config:
            changed = sorted(k for k in set(state.config) | set(config) if state.config.get(k) != config.get(k))
            raise ValueError(f"run {cfg.run!r} exists with another config (different: {', '.join(changed)}); "
                             "--resume needs the same config and --set values it was started with")
        if state.status == "finished":
            return True
        await self._wait_for_owner(state)
        state = await get_run(self.bus, cfg.run) or state
        ended = end_of(state)
        self.num_published = state.num_tasks_published
        self.first_step = state.trainer_step
        if ended is not None:
            # Inference dropped the tasks it held (the run had ended): the supply starts over from here.
            self.first_task = self.num_published
        why = f" ({ended.reason})" if ended is not None else ""
        self.say(f"run {cfg.run}: resuming at step {state.trainer_step} of {cfg.trainer.num_steps}{why}")
        await update_run(self.bus, cfg.run, status="running" if state.status != "created" else "created",
                         ended_at=None, reason=None, scorers=scorers, **self._lease_fields())
        return False

    async def _wait_for_owner(self, state: events.RunState) -> None:
        """Until the run's current owner is gone: its lease expired, or it is a dead process of this host."""
        while end_of(state) is None and state.owner not in (None, self.owner) and not owner_is_gone(state.owner):
            expires = state.lease_expires_at
            if expires is None:
                return
            self.say(f"run {state.id} is owned by {state.owner} until {expires.isoformat()}; waiting for its lease "
                     "to expire (stop that process to take over sooner)")
            if await wait_set(self.stopping, max((expires - events.utc_now()).total_seconds(), 0.0) + 0.5):
                raise StackError(f"stopped while waiting for run {state.id}'s owner")
            state = await get_run(self.bus, state.id) or state

    async def _renew_lease(self) -> None:
        """Keep the lease: renewed every third of run_lease_s; a failed renewal is retried sooner.
        A lease that lapsed meanwhile (NATS unreachable that long) may have made inference
        release the run's queued tasks: the supply then publishes tasks for the steps left."""
        period_s = self.settings.run_lease_s / 3
        expires = events.utc_now() + timedelta(seconds=self.settings.run_lease_s)
        while True:
            await asyncio.sleep(period_s)
            fields = self._lease_fields()
            try:
                await update_run(self.bus, self.cfg.run, **fields)
            except (TimeoutError, nats.errors.Error) as exc:
                self.say(f"run {self.cfg.run}: renewing the run's lease failed ({type(exc).__name__}: {exc}); "
                         "retrying")
                period_s = min(5.0, self.settings.run_lease_s / 6)
                continue
            period_s = self.settings.run_lease_s / 3
            if events.utc_now() > expires:
                self.say(f"run {self.cfg.run}: its lease had lapsed at {expires.isoformat()}, so inference may have "
                         "released its queued tasks; publishing tasks for the steps left")
                self.first_task, self.first_step = self.num_published, self._last_step()
                await self._publish_tasks()
            expires = fields["lease_expires_at"]

    async def _end(self, status: str, reason: str) -> None:
        """Mark the run ended by this owner; the NATS connection may be gone already (said, not raised)."""
        try:
            state = await get_run(self.bus, self.cfg.run)
            if state is not None and state.status != "finished":
                await update_run(self.bus, self.cfg.run, status=status, ended_at=events.utc_now(), reason=reason,
                                 lease_expires_at=None)
                self.say(f"run {self.cfg.run}: {status} ({reason})")
        except (TimeoutError, nats.errors.Error) as exc:
            self.say(f"run {self.cfg.run}: could not mark the run {status} ({type(exc).__name__}: {exc}); its "
                     f"lease expires within {self.settings.run_lease_s:g}s and it is then seen as abandoned")

    async def _check_services(self) -> None:
        from flywheel.contract.service import read_heartbeats

        deadline = time.monotonic() + self.start_timeout_s
        while True:
            live = {b.service for b in await read_heartbeats(self.bus) if b.status == "ok"}
            missing = [s for s in RUN_SERVICES if s not in live]
            if not missing:
                return
            if time.monotonic() > deadline or self.stopping.is_set():
                raise StackError(f"no live {', '.join(missing)} service on {self.settings.resolved_nats_url}: "
                                 "start them with `flywheel up`, or let `flywheel run` start the stack "
                                 "(it does when no NATS answers)")
            await asyncio.sleep(0.5)

    async def _publish_tasks(self, num_dropped: int | None = None) -> None:
        """Publish tasks up to what the run needs: a group for every step left, what the
        staleness bound lets inference run ahead, and one group for each group's worth of
        rollouts the trainer dropped (they are replaced). Called again as drops come in."""
        async with self._supplying:  # the step follower and the lease keeper both call it
            if num_dropped is not None:
                self.num_dropped = max(self.num_dropped, num_dropped)
            await self._publish_more()

    async def _publish_more(self) -> None:
        cfg, num_dropped = self.cfg, self.num_dropped
        if cfg.num_tasks is not None:
            wanted = max(cfg.num_tasks, self.num_published) if self.first_task == 0 else (
                self.first_task + cfg.num_tasks)
        else:
            steps_left = cfg.trainer.num_steps - (self.first_step if self.first_task else 0)
            wanted = (self.first_task + (steps_left + cfg.trainer.max_off_policy_steps + 2) * cfg.groups_per_step
                      + -(-num_dropped // cfg.group_size))
        if wanted <= self.num_published:
            return
        assert self.env is not None
        if len(self.rows) < wanted:
            self.rows = self.env.load_tasks(2 * wanted, seed=cfg.task_seed)
        numbered = list(enumerate(self.rows, 1))[self.num_published:wanted]
        tasks = [task for position, row in numbered
                 for task in make_tasks(cfg.run, subject_name(cfg.env, self.env), [(position, row)],
                                        num_rollouts=cfg.group_size, sampling=cfg.task_sampling(position - 1))]
        await self.bus.publish_many(tasks)
        if self.num_published == 0:
            self.say(f"run {cfg.run}: published {len(tasks)} tasks of {cfg.group_size} rollouts each "
                     f"({cfg.env}); {cfg.trainer.num_steps} steps of {cfg.trainer.batch_size} rollouts")
        elif self.num_published == self.first_task:
            self.say(f"run {cfg.run}: published {len(tasks)} tasks for the {cfg.trainer.num_steps - self.first_step} "
                     "steps left")
        else:
            self.say(f"run {cfg.run}: published {len(tasks)} more tasks to replace dropped rollouts")
        self.num_published = wanted
        await update_run(self.bus, cfg.run, num_tasks_published=wanted)

    async def _follow(self, trainer: TrainerSupervisor) -> bool:
        """Print a line a step until the last one (True), or until a stop is asked (False)."""
        cfg = self.cfg
        updates: asyncio.Queue[events.WeightUpdate] = asyncio.Queue()
        watching = asyncio.ensure_future(self._watch_weights(updates))
        letters = asyncio.ensure_future(self._watch_dead_letters())
        last_step_s = last_state_s = time.monotonic()
        try:
            while not self.stopping.is_set():
                await trainer.check()
                if time.monotonic() - last_state_s > STATE_CHECK_S:
                    last_state_s = time.monotonic()
                    if await self._stopped_by_other():
                        return False
                if watching.done():
                    await watching  # raises what ended the watch
                try:
                    update = await asyncio.wait_for(updates.get(), 1.0)
                except TimeoutError:
                    if time.monotonic() - last_step_s > QUIET_STEP_S:
                        await self._say_waiting(trainer, time.monotonic() - last_step_s)
                        last_step_s = time.monotonic()
                    continue
                self.seen_weights = True
                if update.version == 0 and not self.progress.steps:
                    self.say(f"run {cfg.run}: weights version 0 published (after {cfg.sft.steps} SFT steps)")
                    self.progress.started_s = time.monotonic()
                row = self.progress.add(update)
                await self._publish_tasks(update.num_dropped_total)
                if row is not None:
                    trainer.progressed()
                    last_step_s = time.monotonic()
                    self.say(format_step(row, cfg.trainer.num_steps, await self._in_flight(), self.metric_names))
                if update.trainer_step >= cfg.trainer.num_steps:
                    return True
            return False
        finally:
            watching.cancel()
            letters.cancel()
            await asyncio.gather(watching, letters, return_exceptions=True)

    async def _stopped_by_other(self) -> bool:
        """Whether someone else stopped the run (``flywheel runs stop``, the HTTP API): then it is
        said, and the trainer is stopped (it checkpoints first) as on Ctrl-C."""
        try:
            state = await get_run(self.bus, self.cfg.run)
        except (TimeoutError, nats.errors.Error):
            return False  # the bus is away for now; asked again soon
        if state is None or state.status != "stopped":
            return False
        self.stopped_by_other = state.reason or "stopped"
        self.say(f"run {self.cfg.run}: {self.stopped_by_other}; stopping its trainer (it checkpoints first); "
                 f"`flywheel runs resume {self.cfg.run}` goes on from there")
        return True

    async def _watch_weights(self, out: asyncio.Queue[events.WeightUpdate]) -> None:
        watching = asyncio.Event()  # never set: the watch ends when this task is cancelled
        async for update in watch(self.bus, f"weights.{self.cfg.run}", events.WeightUpdate, watching,
                                  watcher="flywheel-run-weights"):
            await out.put(update)

    async def _watch_dead_letters(self) -> None:
        """Say, on the user's screen, each message of this run that a service gave up on (a task
        inference could not roll out, a rollout no scorer could score) and why: the first few one
        by one, then a count now and then."""
        run = self.cfg.run
        never = asyncio.Event()  # the watch ends when this task is cancelled
        async for letter in watch(self.bus, "dead.>", events.DeadLetter, never, watcher="flywheel-run-dead",
                                  start_time=self.started_at):
            if letter.original_subject.split(".")[1:2] != [run]:
                continue
            self.num_dead_letters += 1
            n = self.num_dead_letters
            if n <= NUM_LETTERS_SAID:
                self.say(f"run {run}: {letter.consumer} gave up on {letter.original_subject} "
                         f"(dead-lettered): {letter.reason}")
            elif n in (NUM_LETTERS_SAID + 1, 10 * NUM_LETTERS_SAID) or n % 100 == 0:
                self.say(f"run {run}: {n} messages dead-lettered so far (flywheel status; the DEAD stream "
                         "holds each with its reason)")

    async def _say_waiting(self, trainer: TrainerSupervisor, quiet_s: float) -> None:
        """What the run waits for, on the user's screen: what is missing (a scorer, a replica,
        weights), the trainer's last log line and the queues."""
        lines = [line for line in trainer.process.log_tail().splitlines() if line.startswith("  | ")]
        last = lines[-1].removeprefix("  | ") if lines else "(nothing logged)"
        in_flight = await self._in_flight()
        missing = await self._missing()
        self.say(f"run {self.cfg.run}: no new step for {quiet_s:.0f}s"
                 + (f"; waiting for {'; '.join(missing)}" if missing else "")
                 + f"; rollouts in flight in inference: {in_flight if in_flight is not None else 'unknown'}"
                 + f"; the trainer's last log line: {last}")

    async def _missing(self) -> list[str]:
        """What the run needs and does not have: a scorer of its reward with no live process, no
        inference replica, no weights yet; and the messages of the run dead-lettered so far."""
        try:
            live = {beat.service for beat in await read_heartbeats(self.bus)}
        except (TimeoutError, nats.errors.Error):
            return []
        assert self.env is not None
        missing = []
        own = set(self.env.weights)
        if own & set(self.required) and "scorer" not in live:
            missing.append(f"the built-in scorer (no process scores {self.env.name}'s rewards: is `flywheel up` "
                           "running?)")
        for name in sorted(set(self.required) - own):
            if f"scorer-{name}" not in live:
                missing.append(f"scorer {name!r}: no process runs it (start it with `flywheel scorer "
                               f"MODULE:FUNCTION --env {subject_name(self.cfg.env, self.env)} --name {name}`)")
        if "inference" not in live:
            missing.append("an inference replica (none is running)")
        if not self.seen_weights:
            missing.append("weights version 0 (the trainer has not published its first weights)")
        if self.num_dead_letters:
            missing.append(f"rollouts that will not come: {self.num_dead_letters} of the run's messages were "
                           "dead-lettered (reasons above)")
        return missing

    async def _in_flight(self) -> int | None:
        """Rollouts of the run being generated now, summed over the inference replicas' heartbeats
        (admitted and not finished; tasks waiting for admission are not in flight); None when no
        replica reports the run."""
        try:
            beats = await read_heartbeats(self.bus)
        except (TimeoutError, nats.errors.Error):
            return None
        counts = [b.info.get("runs", {}).get(self.cfg.run, {}).get("num_in_flight") for b in beats
                  if b.service == "inference"]
        counts = [c for c in counts if isinstance(c, int)]
        return sum(counts) if counts else None


def new_run_id(base: str) -> str:
    return f"{base}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``--set dotted=value`` on a config's data: ``trainer.lr``, ``trainer.loss.clip_eps``. A
    part given by its bare name (``--set trainer.engine=deepspeed`` before ``--set
    trainer.engine.zero_stage=2``) becomes ``{"type": name}`` so its fields can be set."""
    section = data
    *parents, leaf = dotted.split(".")
    for i, key in enumerate(parents):
        if isinstance(section.get(key), str):
            section[key] = {"type": section[key]}
        if key not in section:
            section[key] = {}  # a table the config may not have yet ([rewards.x], [env_args])
        section = section[key]
        if not isinstance(section, dict):
            raise ValueError(f"--set {dotted}: {'.'.join(parents[:i + 1])} is a value, not a table")
    section[leaf] = value


def main_job(config_path: str, settings: Settings, run_id: str | None = None,
             overrides: dict[str, Any] | None = None, resume: bool = False) -> dict[str, Any]:
    cfg = RunConfig.from_toml(config_path)
    data = cfg.model_dump()
    for dotted, value in (overrides or {}).items():
        apply_override(data, dotted, value)
    # A new run gets the time in its id; --resume without --run-id means the run the config names.
    data["run"] = run_id or (cfg.run if resume else new_run_id(cfg.run))
    cfg = RunConfig.parse(data, source=config_path)
    return asyncio.run(MainJob(cfg, settings, resume=resume).run())

