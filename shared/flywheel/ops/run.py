"""``flywheel run CONFIG.toml``: the main job, a training run from one command.

What it does, in order:

1. validates the run config (:class:`flywheel.contract.config.RunConfig`) and gives the run a
   fresh id (``<run>-<UTC time>``, or ``--run-id``);
2. uses the services that run (``flywheel up`` in another terminal, or a deployment), or,
   when no NATS answers, brings up the embedded stack itself and stops it at the end;
3. registers the run with its config in the run-state bucket (every service reads it from
   there); an orchestrator (``flywheel_orchestrator``, one of the stack's services) claims
   it and owns it from there: it starts and restarts the run's trainer, publishes its tasks,
   keeps its lease and writes ``summary.json`` and ``reward.png`` in the run folder
   (``<data_dir>/runs/<run>``, on the orchestrator's machine) at the end;
4. follows it: a line a step from the trainer's weight updates (reward, staleness, tokens/s,
   rollouts in flight), the owner's notes (trainer started, restarting, tasks published),
   each of the run's messages a service gave up on, and, when no step comes for a while,
   what it waits for (an orchestrator, a scorer, a replica, weights);
5. at the end prints a summary table.

Ctrl-C detaches: the run goes on (``flywheel runs follow RUN`` shows it again, ``flywheel
runs stop RUN`` stops it). With ``--stop``, or when this process started the embedded stack
(which goes with it), Ctrl-C stops the run instead: marked ``stopped``, its owner stops the
trainer (it checkpoints first), and this process waits for that. A run stopped by someone
else (``flywheel runs stop``, ``POST /v1/runs/RUN/stop``) ends the following too.
``--resume`` goes on with the run ``--run-id`` names (without it: the config's own ``run``,
no time added) instead of refusing an existing id: same config required; a stopped, failed
or abandoned run is made claimable again (:func:`flywheel.contract.runs.resume_run`) and an
orchestrator goes on from its checkpoint; one still running is followed.
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import nats.errors
import nats.js.errors

from flywheel.contract import events, natsusers
from flywheel.contract.bus import Bus, BusConfig, NatsRefused, wait_at_most, watch
from flywheel.contract.checkpoints import run_folder
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import (
    ENDED_STATUSES,
    end_of,
    get_run,
    lease_held,
    new_notes,
    register_run,
    resume_run,
    stop_run,
    task_durable,
    update_run,
)
from flywheel.contract.service import read_heartbeats
from flywheel.contract.settings import Settings
from flywheel.ops.stack import SERVICES, Stack, StackError, start_until_bus
from flywheel.runtime.environments import WorkerPool
from flywheel.runtime.natsserver import MIN_FREE_MIB, free_mib
from flywheel.runtime.overrides import config_with
from flywheel.runtime.reporting import Progress, format_errors, format_step, format_summary, summarize
from flywheel.runtime.runs import RunEnvironment, config_ids, prepare_run
from flywheel.sdk.scoring import describe_reward, reward_definition

RUN_SERVICES = ("orchestrator", "inference", "scorer")  # what a training run needs
QUIET_STEP_S = 30.0  # no step for this long: say what the run waits for
STOP_TIMEOUT_S = 60.0  # a run stopping because its embedded stack failed gets this long, bus still up
NUM_LETTERS_SAID = 5  # dead letters of the run said one by one; after these, a count now and then
STATE_CHECK_S = 1.0  # how often the run's state is read (notes, status)
RELEASE_TIMEOUT_S = 30.0  # after the last step: how long an owner whose lease lapsed may take to let go, from
# its last note (an owner that renews its lease is waited for: its last evals may take minutes)


async def nats_answers(url: str) -> bool:
    """Whether a NATS server (any node of a cluster's comma-separated URLs) answers at ``url``
    and takes its login; NatsRefused when it answers and refuses it."""
    # A refused TCP connection answers at once; the NATS client's own connect waits out its timeout.
    for part in url.split(","):
        parsed = urlsplit(part.strip())
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parsed.hostname or "127.0.0.1", parsed.port or 4222), 1.0)
        except (OSError, TimeoutError):
            continue
        writer.close()
        break
    else:
        return False
    try:
        bus = await Bus.connect(url, "flywheel-run-probe", BusConfig(connect_timeout_s=1.0), ensure=False)
    except NatsRefused:
        raise  # a server answers, and refuses this login: starting another on its port cannot help
    except ConnectionError:
        return False
    await bus.close()
    return True


class RunFailed(StackError):
    """The run failed (its trainer kept failing, or its owner could not run it); the run state says
    ``failed`` with the reason."""


def owner_name() -> str:
    return f"flywheel-run pid {os.getpid()} on {socket.gethostname()}"


class MainJob:
    """``flywheel run``: register the run, follow it to its end (or detach), say what it waits for.

    ``stop_on_exit``: Ctrl-C stops the run (as ``--stop`` asks) instead of detaching; always so
    when this process starts the embedded stack, which goes with it."""

    def __init__(self, cfg: RunConfig, settings: Settings, out: TextIO = sys.stdout,
                 start_timeout_s: float = 300.0, resume: bool = False, stop_on_exit: bool = False) -> None:
        self.cfg = cfg
        self.settings = settings
        self.out = out
        self.start_timeout_s = start_timeout_s
        self.resume = resume
        self.stop_on_exit = stop_on_exit
        self.run_dir = run_folder(settings.data_dir.resolve(), cfg.run)
        self.stopping = asyncio.Event()
        self.failure: str | None = None  # why this process ended the run, when it was not a signal
        self.progress = Progress()
        self.environments: dict[str, RunEnvironment] = {}  # loaded as every service loads them
        self.first_step = 0  # the trainer step the run was at when this process began following it
        self.required: dict[str, float] = {}  # the scorers of the run's reward, name -> weight (every environment's)
        self.env_scorers: dict[str, dict[str, float]] = {}  # a run with several environments: each one's
        self.started_at = events.utc_now()  # dead letters from here on are this run's to say
        self.num_dead_letters = 0  # of the run's messages, since started_at
        self.seen_weights = False  # a weight update of the run came (version 0 at least)
        self.said_foreign = False  # a weight update not of the run's trainer was ignored (said once)
        self.num_notes_seen = 0  # of the owner's notes (RunState.notes)
        self.errors: list[events.ErrorGroup] = []  # the dropped rollouts' errors by kind, last read
        self.last_note: str | None = None
        self.status = "created"  # as end_of sees it, last read
        self.owner: str | None = None  # the run's owner, last read
        self.owner_live = False  # whether that owner's lease had not expired, last read
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
            self.say(f"no NATS at {natsusers.redacted(url)}: starting the embedded stack (it stops with this "
                     "command, and the run with it)")
            self.stop_on_exit = True
            services = {name: spec for name, spec in SERVICES.items()}
            stack = Stack(self.settings, out=self.out, services=services, start_timeout_s=self.start_timeout_s)
            # The run starts as soon as the bus answers: the orchestrator starts its trainer,
            # which loads the model while the other services start (what the run still waits
            # for, it says).
            stack_task = await start_until_bus(stack)
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
        """Train while the embedded stack starts and runs. A stack that fails (to start) ends
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
        """Register the run (its orchestrator takes it from there) and follow it to its end.
        ``check_services``: first wait (bounded) for the services of a stack this process did
        not start."""
        cfg = self.cfg
        self._bus = bus = await Bus.connect(self.settings.resolved_nats_url, "flywheel-run")
        # The run's environments load here only to be checked (and their sampling read), in
        # workers like everywhere: never in this process.
        pool = WorkerPool(self.settings.workers, self.settings.data_dir, name="run")
        try:
            # The environments' sampling settings are defaults under the config's own.
            cfg, self.environments = await prepare_run(pool, cfg, self.settings.resolved_gateway_url, cfg.tenant)
            await pool.close()
            self.cfg = cfg
            if check_services:
                await self._check_services()
            if await self._register():
                summary = self._summary_from_folder()
                self.say(f"run {cfg.run} has finished already; its summary:\n" + format_summary(summary))
                return summary
            outcome = await self._follow()
        finally:
            await pool.close()
            await bus.close()
        return self._finish(outcome)

    async def _register(self) -> bool:
        """Register the run with its config (an orchestrator claims it), or with ``resume`` make the
        existing one go on. True when there is nothing to do (the resumed run had finished)."""
        cfg = self.cfg
        config = cfg.model_dump()
        # The run's reward, for the trace store (the trainer's too).
        scorers, env_scorers = reward_definition(cfg, self.environments)
        self.required, self.env_scorers = scorers, env_scorers
        for name, found in self.environments.items():
            where = f" ({name}, weight {found.config.weight:g})" if env_scorers else ""
            self.say(f"run {cfg.run}{where}: {describe_reward(env_scorers.get(name, scorers), found.env)}")
        state, created = await register_run(self.bus, cfg.run, cfg.tenant, config=config, scorers=scorers,
                                            env_scorers=env_scorers, env_ids=config_ids(self.environments))
        if created:
            return False
        if not self.resume:
            raise ValueError(f"run {cfg.run!r} exists already; give another --run-id, or add --resume to go on "
                             "where it stopped")
        if state.config != config:
            changed = sorted(k for k in set(state.config) | set(config) if state.config.get(k) != config.get(k))
            raise ValueError(f"run {cfg.run!r} exists with another config (different: {', '.join(changed)}); "
                             "--resume needs the same config and --set values it was started with")
        if state.status == "finished":
            return True
        self.first_step = state.trainer_step
        self.num_notes_seen = state.num_notes
        ended = end_of(state)
        if ended is None and state.status == "paused":
            self.say(f"run {cfg.run}: resuming at step {state.trainer_step} of {cfg.trainer.num_steps} "
                     f"({state.reason}; its owner {state.owner or 'none yet'} starts the trainer again)")
            await resume_run(self.bus, cfg.run)
            return False
        if ended is None:
            self.say(f"run {cfg.run} is {state.status} (owner {state.owner or 'none yet'}); following it")
            return False
        self.say(f"run {cfg.run}: resuming at step {state.trainer_step} of {cfg.trainer.num_steps} ({ended.reason})")
        await resume_run(self.bus, cfg.run)
        return False

    def _summary_from_folder(self) -> dict[str, Any]:
        path = self.run_dir / "summary.json"
        if path.exists():
            return dict(json.loads(path.read_text()))
        return summarize(self.progress, self.cfg, self.run_dir, self.metric_names)

    def _finish(self, outcome: str) -> dict[str, Any]:
        cfg = self.cfg
        summary = summarize(self.progress, cfg, self.run_dir, self.metric_names)
        written = self.run_dir / "summary.json"  # the owner's, on this machine: with the evals' figures
        if written.exists():
            summary |= {k: v for k, v in json.loads(written.read_text()).items() if k.startswith("eval.")}
        if outcome == "detached":
            self.say(f"run {cfg.run}: no longer following it; it goes on (`flywheel runs follow {cfg.run}` shows it, "
                     f"`flywheel runs stop {cfg.run}` stops it)")
            return summary
        self.say("summary:\n" + format_summary(summary))
        if self.errors:
            self.say("rollouts dropped for an error, by kind:\n" + format_errors(self.errors))
        png = self.run_dir / "reward.png"
        self.say(f"reward curve: {png}" if png.exists() else
                 f"reward curve: written by the run's orchestrator as {png} on its machine (with the `run` extra, "
                 "matplotlib)")
        if outcome == "failed":
            raise RunFailed(f"run {cfg.run} failed: {self.failure or 'see the lines above'}")
        return summary

    def _last_step(self) -> int:
        return int(self.progress.steps[-1]["step"]) if self.progress.steps else self.first_step

    async def _check_services(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            live = {b.service for b in await read_heartbeats(self.bus) if b.status == "ok"}
            missing = [s for s in RUN_SERVICES if s not in live]
            if not missing:
                return
            if time.monotonic() > deadline or self.stopping.is_set():
                where = natsusers.redacted(self.settings.resolved_nats_url)
                raise StackError(f"no live {', '.join(missing)} service on {where}: "
                                 "start them with `flywheel up`, or let `flywheel run` start the stack "
                                 "(it does when no NATS answers)")
            await asyncio.sleep(0.5)

    async def _follow(self) -> str:
        """Print a line a step and the owner's notes until the run ends (``finished``, ``failed``,
        ``stopped``) or Ctrl-C (``detached``, or ``stopped`` with ``stop_on_exit``)."""
        cfg = self.cfg
        updates: asyncio.Queue[events.WeightUpdate] = asyncio.Queue()
        watching = asyncio.ensure_future(self._watch_weights(updates))
        letters = asyncio.ensure_future(self._watch_dead_letters())
        last_step_s = last_state_s = time.monotonic()
        try:
            while not self.stopping.is_set():
                if watching.done():
                    await watching  # raises what ended the watch
                if time.monotonic() - last_state_s > STATE_CHECK_S:
                    last_state_s = time.monotonic()
                    ended = await self._read_state()
                    if ended is not None and (ended != "finished" or self._last_step() >= cfg.trainer.num_steps
                                              or self.owner is None):
                        return ended
                update = await wait_at_most(updates.get(), STATE_CHECK_S)
                if update is None:
                    if time.monotonic() - last_step_s > QUIET_STEP_S and self.status != "paused":
                        await self._say_waiting(time.monotonic() - last_step_s)
                        last_step_s = time.monotonic()
                    continue
                foreign = cfg.foreign_step(update.trainer_step)
                if foreign is not None:
                    if not self.said_foreign:
                        self.say(f"run {cfg.run}: {foreign}")
                        self.said_foreign = True
                    continue
                self.seen_weights = True
                if update.version == 0 and not self.progress.steps:
                    self.say(f"run {cfg.run}: weights version 0 published (after {cfg.sft.steps} SFT steps)")
                    self.progress.started_s = time.monotonic()
                row = self.progress.add(update)
                if row is not None:
                    last_step_s = time.monotonic()
                    self.say(format_step(row, cfg.trainer.num_steps, await self._in_flight(), self.metric_names))
                if update.trainer_step >= cfg.trainer.num_steps:
                    await self._await_end()
                    return "finished"
            return await self._on_exit()
        finally:
            watching.cancel()
            letters.cancel()
            await asyncio.gather(watching, letters, return_exceptions=True)

    async def _read_state(self) -> str | None:
        """Say the owner's new notes and the run's status changes; the status once it ended
        (finished, failed, stopped; not abandoned, which lasts until an orchestrator takes it)."""
        try:
            state = await get_run(self.bus, self.cfg.run)
        except (TimeoutError, nats.errors.Error):
            return None  # the bus is away for now; asked again soon
        if state is None:
            return None
        for note in new_notes(state, self.num_notes_seen):
            self.say(f"run {self.cfg.run}: {note}")
            self.last_note = note
        self.num_notes_seen = state.num_notes
        said = {(g.source, g.error) for g in self.errors}
        for group in state.errors:
            if (group.source, group.error) not in said:
                self.say(f"run {self.cfg.run}: {group.source} failed on rollout {group.example}: {group.error}; "
                         "rollouts that fail are dropped, not trained (counted by kind at the end and on the run's "
                         "page)")
        self.errors = list(state.errors)
        self.owner = state.owner
        self.owner_live = lease_held(state)
        end = end_of(state)
        status = end.status if end is not None else state.status
        if status != self.status:
            self.status = status
            if status == "abandoned":
                self.say(f"run {self.cfg.run}: {end}; waiting for an orchestrator to take it over")
            elif status in ("failed", "stopped"):
                self.failure = self.failure or (state.reason or status)
                self.say(f"run {self.cfg.run}: {status} ({state.reason or 'no reason given'})")
            elif status == "paused":
                self.say(f"run {self.cfg.run}: paused ({state.reason or 'no reason given'}); `flywheel runs resume "
                         f"{self.cfg.run}` goes on")
        return status if status in ENDED_STATUSES else None

    async def _await_end(self) -> None:
        """After the last step: until the owner let go of the run (its summary is written). While
        the owner renews its lease (its last evals can take minutes on a real model) this waits,
        saying so every QUIET_STEP_S; once no owner holds a live lease, for RELEASE_TIMEOUT_S more
        at most (a new note gives it the bound again)."""
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        said_at = time.monotonic()
        while time.monotonic() < deadline:
            seen = self.num_notes_seen
            await self._read_state()
            if self.status in ENDED_STATUSES and self.owner is None:
                return
            now = time.monotonic()
            if self.num_notes_seen != seen or self.owner_live:
                deadline = now + RELEASE_TIMEOUT_S
            if self.num_notes_seen != seen:
                said_at = now
            elif now - said_at >= QUIET_STEP_S:
                self.say(f"run {self.cfg.run}: training finished; waiting for its owner ({self.owner or 'none'}) to "
                         f"end the run and write its summary; its last note: {self.last_note or '(none)'}")
                said_at = now
            await asyncio.sleep(0.2)

    async def _on_exit(self) -> str:
        """Ctrl-C, or the embedded stack failing: stop the run (and wait for its owner to let go of
        it) when this process owns its stack or was asked to; else detach."""
        cfg = self.cfg
        if not self.stop_on_exit and self.failure is None:
            return "detached"
        try:
            if self.failure is not None:
                await update_run(self.bus, cfg.run, status="failed", ended_at=events.utc_now(), reason=self.failure)
                self.say(f"run {cfg.run}: failed ({self.failure})")
            else:
                state = await stop_run(self.bus, cfg.run, f"{owner_name()} (SIGINT/SIGTERM)")
                self.say(f"run {cfg.run}: {state.reason}; waiting for its owner to stop the trainer")
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while time.monotonic() < deadline:
                await self._read_state()
                if self.owner is None:
                    break
                await asyncio.sleep(0.2)
            else:
                self.say(f"run {cfg.run}: its owner ({self.owner}) did not let go of it within {STOP_TIMEOUT_S:g}s")
        except (TimeoutError, nats.errors.Error) as exc:
            self.say(f"run {cfg.run}: could not stop the run ({type(exc).__name__}: {exc})")
        return "failed" if self.failure is not None and self.status != "stopped" else "stopped"

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

    async def _say_waiting(self, quiet_s: float) -> None:
        """What the run waits for, on the user's screen: what is missing (an orchestrator, a scorer,
        a replica, weights), the owner's last note and the queues."""
        hosting = await self._hosting_now()
        in_flight = self._in_flight_of(hosting) if hosting is not None else None
        missing = await self._missing()
        self.say(f"run {self.cfg.run}: no new step for {quiet_s:.0f}s"
                 + (f"; waiting for {'; '.join(missing)}" if missing else "")
                 + f"; rollouts in flight in inference: {in_flight if in_flight is not None else 'unknown'}"
                 + self._admission_wait(hosting or [])
                 + f"; its owner's last note: {self.last_note or '(none)'}")

    def _admission_wait(self, hosting: list[dict[str, Any]]) -> str:
        """The rollouts the replicas hold back, and the bound that moves when the trainer steps;
        those that wait for a place under the tenant's quota, and the quota."""
        waiting = sum(h["num_waiting"] for h in hosting if isinstance(h.get("num_waiting"), int))
        bounds = [h for h in hosting if isinstance(h.get("max_issued"), int)]
        said = ""
        if waiting and bounds:
            bound = max(bounds, key=lambda h: h["max_issued"])
            said = (f"; {waiting} waiting there for admission or a place (the staleness bound: {bound['max_issued']} "
                    "rollouts issued since the run began, over every replica, until the trainer's next step)")
        quota = [h for h in hosting if isinstance(h.get("num_waiting_tenant"), int) and h["num_waiting_tenant"] > 0]
        if quota:
            full = max(quota, key=lambda h: h["num_waiting_tenant"])
            said += (f"; {sum(h['num_waiting_tenant'] for h in quota)} waiting there for a place under tenant "
                     f"{full.get('tenant')}'s quota (its runs roll out {full.get('tenant_in_flight')} at once in a "
                     f"replica, inference.tenant_max_rollouts_in_flight = {full.get('tenant_max_in_flight')})")
        return said

    async def _missing(self) -> list[str]:
        """What the run needs and does not have: an orchestrator to own it, a scorer of its reward
        with no live process, no inference replica, no weights yet; and the messages of the run
        dead-lettered so far."""
        try:
            beats = await read_heartbeats(self.bus)
        except (TimeoutError, nats.errors.Error):
            return []
        live = {beat.service for beat in beats}
        missing = []
        if "orchestrator" not in live:
            missing.append("an orchestrator to own the run (none is running: is `flywheel up` running?)")
        own = {name for found in self.environments.values() for name in found.env.weights}
        if own & set(self.required) and "scorer" not in live:
            names = ", ".join(found.env.name for found in self.environments.values())
            missing.append(f"the built-in scorer (no process scores {names}'s rewards: is `flywheel up` running?)")
        for name in sorted(set(self.required) - own):
            if f"scorer-{name}" not in live:
                needing = [env for env in self.environments if name in self.env_scorers.get(env, self.required)]
                commands = " and ".join(f"`flywheel scorer MODULE:FUNCTION --env {env} --name {name}`"
                                        for env in needing)
                missing.append(f"scorer {name!r}: no process runs it (start it with {commands})")
        if "inference" not in live:
            missing.append("an inference replica (none is running)")
        hosted = {name for beat in beats if beat.service == "inference"
                  for name in beat.info.get("teachers", {}).get(self.cfg.run, {})}
        for name, teacher in self.cfg.teachers.items():
            if name not in hosted and "inference" in live:
                missing.append(f"teacher {name!r} ({teacher.model}): no inference replica hosts it yet (it loads "
                               "its model once the run is running; its log says why it does not)")
        if not self.seen_weights:
            warm_up = (f"; it first warms the model up with sft.steps = {self.cfg.sft.steps} supervised steps, "
                       "which its log counts" if self.cfg.sft.steps else "")
            missing.append(f"weights version 0 (the trainer has not published its first weights{warm_up})")
        hosting = self._hosting(beats)
        if self.seen_weights and hosting and all(h.get("policy_version") is None for h in hosting):
            errors = sorted({str(h["weights_error"]) for h in hosting if h.get("weights_error")})
            missing.append("an inference replica with the run's weights (published; none has loaded them yet"
                           + (f": {'; '.join(errors)}" if errors else ": a large model's take a while; the "
                              "inference log says how far it is") + ")")
        if self.num_dead_letters:
            missing.append(f"rollouts that will not come: {self.num_dead_letters} of the run's messages were "
                           "dead-lettered (reasons above)")
        return missing + await self._bus_trouble()

    async def _bus_trouble(self) -> list[str]:
        """What on the bus itself holds the run: JetStream refusing requests (a full disk, a store
        that failed), inference's durable of the run's tasks gone, the run's tasks gone from TASKS."""
        js = self.bus.js
        store = self.settings.data_dir.resolve() / "nats"  # where `flywheel up` on this data folder keeps it
        if store.is_dir() and (free := free_mib(store)) < MIN_FREE_MIB:
            said = (f"disk full: {free} MiB free where nats-server keeps its store ({store}); the bus stores none of "
                    f"the run's events until space is freed there (`flywheel up` restarts nats-server once "
                    f"{MIN_FREE_MIB} MiB are free)")
            return [said]
        try:
            await js.account_info()
        except (TimeoutError, nats.errors.Error) as exc:
            said = (f"the bus's JetStream, which refuses requests ({type(exc).__name__}: {exc}): a full disk where "
                    "nats-server keeps its store? free space there; nats-server's log says why")
            return [said]
        try:
            state = await get_run(self.bus, self.cfg.run)
            if state is None or not state.num_tasks_published:
                return []
            held = await js.stream_info("TASKS", subjects_filter=f"tasks.{self.cfg.run}.>")
        except (TimeoutError, nats.errors.Error):
            return []
        out = []
        if not sum((held.state.subjects or {}).values()):
            out.append(f"the run's tasks: the TASKS stream holds none of the {state.num_tasks_published} its "
                       "orchestrator published (purged or deleted?); the run's owner publishes what the run still "
                       "needs within seconds (a note says so)")
        try:
            await js.consumer_info("TASKS", task_durable(self.cfg.run))
        except nats.js.errors.NotFoundError:
            out.append(f"inference's consumer of the run's tasks ({task_durable(self.cfg.run)} on TASKS) is gone "
                       "(deleted?): a live inference makes it again at its next pull")
        except (TimeoutError, nats.errors.Error):
            pass
        return out

    def _hosting(self, beats: list[events.ServiceHeartbeat]) -> list[dict[str, Any]]:
        """The run's counters in each inference replica's heartbeat that reports the run."""
        return [b.info["runs"][self.cfg.run] for b in beats if b.service == "inference"
                and isinstance(b.info.get("runs"), dict) and isinstance(b.info["runs"].get(self.cfg.run), dict)]

    async def _hosting_now(self) -> list[dict[str, Any]] | None:
        """:meth:`_hosting` of the live heartbeats; None when they cannot be read."""
        try:
            return self._hosting(await read_heartbeats(self.bus))
        except (TimeoutError, nats.errors.Error):
            return None

    async def _in_flight(self) -> int | None:
        """Rollouts of the run being generated now, summed over the inference replicas' heartbeats
        (admitted and not finished; tasks waiting for admission are not in flight); None when no
        replica reports the run."""
        hosting = await self._hosting_now()
        return self._in_flight_of(hosting) if hosting is not None else None

    @staticmethod
    def _in_flight_of(hosting: list[dict[str, Any]]) -> int | None:
        counts = [h["num_in_flight"] for h in hosting if isinstance(h.get("num_in_flight"), int)]
        return sum(counts) if counts else None


def new_run_id(base: str) -> str:
    return f"{base}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def main_job(config_path: str, settings: Settings, run_id: str | None = None,
             overrides: dict[str, Any] | None = None, resume: bool = False, stop: bool = False) -> dict[str, Any]:
    trusted = settings.trusted_modules
    named = RunConfig.from_toml(config_path, trusted).run
    # A new run gets the time in its id; --resume without --run-id means the run the config names.
    cfg = config_with(config_path, overrides or {}, run_id or (named if resume else new_run_id(named)), trusted)
    return asyncio.run(MainJob(local_data(local_models(cfg, trusted), trusted), settings, resume=resume,
                               stop_on_exit=stop).run())


def local_data(cfg: RunConfig, trusted_modules: Sequence[str] = ()) -> RunConfig:
    """``cfg`` with each data file it names (``sft.data``, the SFT terms' ``data``) made absolute, as
    the trainer reads it wherever it runs from; a ValueError naming the field for a file that is
    not there, before anything starts. A local ``dataset`` folder of each is made absolute too."""
    data = cfg.model_dump()
    tables = [("sft", data["sft"]), ("trainer.sft_term", data["trainer"]["sft_term"]),
              *((f"envs.{i}.sft_term", env["sft_term"]) for i, env in enumerate(data["envs"]))]
    changed = False
    for where, table in tables:
        dataset = (table or {}).get("dataset")
        if dataset and Path(dataset).expanduser().exists():  # a local folder; else a hub id, found where it is read
            table["dataset"] = str(Path(dataset).expanduser().resolve())
            changed = True
        if not table or not table.get("data"):
            continue
        path = Path(table["data"]).expanduser()
        if not path.is_file():
            raise ValueError(f"{where}.data={table['data']!r}: no such file; give a JSON Lines file of chats or a "
                             "trace API export (`GET /v1/rollouts/export`)")
        table["data"] = str(path.resolve())
        changed = True
    return RunConfig.parse(data, trusted_modules=trusted_modules) if changed else cfg


def local_models(cfg: RunConfig, trusted_modules: Sequence[str] = ()) -> RunConfig:
    """``cfg`` with each model that is a folder (a path: absolute, or from ``.``), the run's own
    (``model.name``) and its teachers', made absolute, as every service reads it; a ValueError
    naming the field for a folder that is not there. A model name ('tiny'), a hub id and 'policy'
    (a teacher of the run's own weights) are found where the model is loaded."""
    data = cfg.model_dump()
    fields = [("model.name", data["model"], "name"),
              *((f"teachers.{name}.model", data["teachers"][name], "model") for name in cfg.teachers)]
    changed = False
    for where, table, key in fields:
        path = Path(table[key]).expanduser()
        if not (path.is_absolute() or table[key].startswith(".")):
            continue
        if not (path / "config.json").exists():
            raise ValueError(f"{where}={table[key]!r}: no model folder there (no config.json); give a Hugging Face "
                             "model folder, e.g. one `flywheel export RUN DIR` wrote, a model name such as 'tiny'"
                             + (", or 'policy' (the run's own weights)" if where.startswith("teachers.") else ""))
        table[key] = str(path.resolve())
        changed = True
    return RunConfig.parse(data, trusted_modules=trusted_modules) if changed else cfg

