"""Tasks in: which runs' tasks this process consumes, and each delivery screened and handled.

- Tasks come from a durable pull consumer on TASKS per run (``inference-<run>``), shared by
  every replica, behind a screen of every task (``inference``) that dead-letters what no run can
  take (:mod:`flywheel_inference.run_tasks`), within the bounds of the settings' ``inference``
  section (:class:`flywheel.contract.settings.InferenceSettings`). Their ack wait is short
  (``ack_wait_s``, 5 s; the bus layer sends ``in_progress`` every third of it for a task still
  being worked on, so a long rollout is not redelivered): the tasks a killed replica held reach
  another one within seconds instead of blocking the run's ``max_ack_pending``. A task is rolled
  out ``num_rollouts`` times as one group (:mod:`flywheel_inference.rollouts`).
- The consumers follow the runs' states (:mod:`flywheel_inference.run_states`): when a run ends
  (finished, failed, stopped, or abandoned: its owner's lease expired, which is checked every
  ``LEASE_CHECK_S`` since nothing writes the state when an owner dies), its waiting tasks are
  released at once (acked, counted as ``num_skipped``), and its consumer stops once its leftover
  tasks are skipped too.

Delivery is at least once (a server restart loses acks; a replica dies mid-task), and budgets
count what reached the bus, never attempts (:mod:`flywheel_inference.publishing`); this process
remembers the tasks it published (the last ``MAX_RECORDED_TASKS`` per run) and acks such a task
again without rolling it out, and a second delivery of a task still in flight here waits for the
first one's outcome instead of running it twice.

A task waiting for its run's admission holds one of its run's ``max_tasks_in_flight`` slots,
never another run's.

Failures: a task that can never succeed is dead-lettered at once with the reason: its run is not
in the runs bucket, has no config, or its state does not decode; it was published after its run
ended (these by the screen); its environment does not load; its row does not match the task
set's schema; bad sampling settings; a group larger than the admission bounds. A task left over
from before its run ended is acked and counted as skipped. Anything else (the model fails to
build, the bus fails) fails the delivery, which the bus retries with backoff before
dead-lettering it. Not covered: the record of published tasks is per process, so a task
redelivered to another replica is rolled out again there (its copies are dropped by the bus
within its duplicate window, and not counted).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from datetime import UTC

from flywheel.contract import events
from flywheel.contract.bus import Bus, Delivery, Reject, wait_at_most
from flywheel.contract.runs import RunEnd, end_of, watch_runs
from flywheel.contract.settings import InferenceSettings
from flywheel.runtime.channel import RemoteError
from flywheel.sdk.environment import EnvironmentLoadError
from flywheel_inference.admission import RunEnded
from flywheel_inference.hosting import Hosting, UnknownRun
from flywheel_inference.rollouts import Rollouts
from flywheel_inference.run_states import RunStates
from flywheel_inference.run_tasks import RunTasks

log = logging.getLogger(__name__)

# Task ids whose group this process published, remembered per run: a redelivery comes
# within a few ack waits, so the last few thousand are plenty.
MAX_RECORDED_TASKS = 4096
LEASE_CHECK_S = 1.0  # how often hosted runs are checked for an expired owner's lease


def _published_after(task: events.Task, end: RunEnd) -> bool:
    """Whether ``task`` was published after its run ended (not left over from before)."""
    created_at = task.created_at if task.created_at.tzinfo else task.created_at.replace(tzinfo=UTC)
    return created_at >= end.since


class TaskIntake:
    """The task consumers of this process (``tasks``: the screen, each run's) and what they
    deliver: each run's consumer follows its state; each task is rolled out once here."""

    def __init__(self, bus: Bus, config: InferenceSettings, states: RunStates, hosting: Hosting,
                 rollouts: Rollouts) -> None:
        self.states = states
        self.hosting = hosting
        self.rollouts = rollouts
        self.tasks = RunTasks(bus, config, self.handle, self.screen)  # the screen and each run's task consumer
        self._published: dict[str, OrderedDict[str, None]] = {}  # per run: tasks whose group went out
        self._in_flight: dict[tuple[str, str], asyncio.Event] = {}  # (run, task id) -> set when handled

    # --- run state ---------------------------------------------------------------------------

    async def watch_runs(self, stopping: asyncio.Event) -> None:
        """Keep every run's current state, and release the waiting tasks of runs that end, until
        ``stopping``. Entries that do not decode are skipped (:func:`flywheel.contract.runs.watch_runs`)."""

        async def on_state(state: events.RunState) -> None:
            self.states.keep(state)
            await self._changed(state.id)

        await watch_runs(self.states.bus, stopping, on_state)

    async def watch_leases(self, stopping: asyncio.Event) -> None:
        """Every LEASE_CHECK_S, end the hosted runs whose owner's lease expired: a dead owner
        writes nothing, so no state change announces it."""
        while not stopping.is_set():
            for run in {*self.tasks.runs(), *self.hosting.runs}:
                await self.states.confirm_lapse(run)
            for run in self.tasks.runs():
                self._follow(run)
            for run in list(self.hosting.runs):
                await self.hosting.check_end(run)
            await wait_at_most(stopping.wait(), LEASE_CHECK_S)

    def _follow(self, run: str) -> None:
        """Consume the run's tasks here while it goes on; once it ended, until its durable is empty."""
        state = self.states.get(run)
        if state is None or not state.config:
            return
        end = self.states.end(run)
        if end is None:
            self.tasks.serve(run)
        else:
            self.tasks.end(run, finished=state.status == "finished")

    async def _changed(self, run: str) -> None:
        """The run's kept state changed: its consumer and its hosting follow."""
        self._follow(run)
        await self.hosting.check_end(run)

    async def _run_end(self, task: events.Task) -> RunEnd | None:
        """How the task's run ended (None: it goes on); Reject when it cannot take tasks, and never will."""
        end = end_of(await self.states.current(task.run))
        if end is not None:  # confirmed by a fresh read: the watcher may not have seen a resume yet
            state = await self.states.current(task.run, fresh=True)
            if self.states.keep_read(task.run, state):
                await self._changed(task.run)
            end = end_of(state)
        return end

    # --- tasks --------------------------------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        """One delivery of a task: rolled out once per process, however often it is delivered."""
        task: events.Task = delivery.event
        key = (task.run, task.id)
        while (first := self._in_flight.get(key)) is not None:
            await first.wait()  # delivered again while the first delivery runs: its outcome decides
        if task.id in self._published.get(task.run, ()):
            log.info("task %s: its group was published already (delivery %d); acked", task.id,
                     delivery.num_delivered)
            return
        done = self._in_flight[key] = asyncio.Event()
        try:
            await self._handle(task)
        finally:
            del self._in_flight[key]
            done.set()

    async def screen(self, delivery: Delivery) -> None:
        """The screen's delivery of a task (every task passes it): what no run can take is
        dead-lettered (Reject); a run that goes on is consumed here; its consumer does the rest."""
        task: events.Task = delivery.event
        end = await self._run_end(task)
        if end is None:
            self.tasks.serve(task.run)
            return
        self.tasks.drain(task.run, finished=end.status == "finished")  # its consumer skips (and counts) leftovers
        if _published_after(task, end):
            raise Reject(f"task {task.id} was published at {task.created_at.isoformat()}, after the run ended: "
                         f"{end.reason}. An ended run takes no tasks: register a new run (`flywheel run CONFIG`) "
                         "and publish the task to it")

    async def _handle(self, task: events.Task) -> None:
        from flywheel.sdk import models

        end = await self._run_end(task)
        if end is not None:
            if _published_after(task, end):
                log.info("task %s: published after its run ended (%s); the screen dead-letters it", task.id,
                         end.reason)
            else:  # left over from the task supply
                log.info("task %s: not sampled (published before the run ended): %s", task.id, end.reason)
                self.hosting.skip(task.run, task.num_rollouts)
            return
        try:
            hosted = await self.hosting.hosted(task.run)
        except (UnknownRun, ValueError) as exc:  # deleted meanwhile, or a config that does not parse
            raise Reject(str(exc)) from exc
        try:
            env = await self.rollouts.environment(task.run, task.env, hosted.config)
        except (EnvironmentLoadError, ValueError) as exc:
            raise Reject(str(exc)) from exc
        try:
            messages = await env.prompt_messages(task.data)
        except EnvironmentLoadError as exc:
            raise Reject(str(exc)) from exc
        except RemoteError as exc:  # the environment's own code raised (a worker that died: retried)
            raise Reject(f"environment {task.env!r}: its first messages for this task failed: "
                         f"{exc.kind}: {exc}") from exc
        sampling = task.sampling or hosted.sampling
        prompt_ids = models.render_prompt(hosted.policy.backend.tokenizer, messages)
        try:
            if task.num_rollouts < 1:
                raise ValueError(f"num_rollouts={task.num_rollouts}: at least 1")
            hosted.admission.check(task.num_rollouts)
            hosted.policy.check([prompt_ids], sampling)
        except ValueError as exc:
            raise Reject(f"task {task.id}: {exc}") from exc
        try:
            async with hosted.admission.slot(task.num_rollouts) as slot:
                slot.num_stored = await self.rollouts.roll_out(task, env, sampling, hosted, messages)
        except RunEnded as exc:
            # Waiting when the run ended: done with, not an error (counted as num_skipped).
            log.info("task %s: not sampled: %s", task.id, exc)
            return
        record = self._published.setdefault(task.run, OrderedDict())
        record[task.id] = None
        if len(record) > MAX_RECORDED_TASKS:
            record.popitem(last=False)
