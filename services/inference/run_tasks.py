"""Each run's tasks through a consumer of its own, so that no run holds another's slots.

Every run's tasks share the TASKS stream, and a consumer delivers in stream order. One consumer
for every run would let the tasks of a run that waits (paused, far ahead of its trainer, slow,
or with thousands queued: a run's task supply publishes the whole run at once) hold all its
slots, and every task behind them in the stream, of any run, would wait as long. Here a run
waits alone:

- The screen (durable ``inference``, every task, shared by the replicas) refuses what no run
  can take: a task of a run that is not registered, has no config or a state that does not
  decode, or was published after its run ended, is dead-lettered at once with the reason. It
  makes sure the consumer of a run that goes on runs here, and acks. It never waits for
  admission, so a flood of one run's tasks passes it at the bus's pace.
- A run that goes on (created, running or paused: :func:`flywheel.contract.runs.end_of` is
  None) has a durable of its own, ``inference-<run>`` on ``tasks.<run>.>``, shared by the
  replicas, with ``inference.max_tasks_in_flight`` slots (its ``max_ack_pending``): there its
  tasks are rolled out, in the order it published them, and wait for its admission
  (:mod:`flywheel_inference.admission`); what it has not taken yet stays in the stream, where
  it holds nothing. Every replica consumes every run that goes on: its consumer is started by
  the run-state watcher, or by the screen when a task comes first.
- A run that ended: its consumer goes on until its durable holds nothing more (leftover tasks
  are acked and counted as skipped, a task published after the end is acked there, the screen
  dead-letters it), then stops; a task of an ended run that reaches the screen starts it
  again for as long (a replica that starts after the end skips the leftovers too). A
  finished run's durable is deleted then (a finished run is never resumed); a stopped,
  failed or abandoned one's is kept, so that a resumed run goes on where its tasks stood.

A consumer of a run that fails (what :meth:`flywheel.contract.bus.Consumer.run` raises) stops
the process, as the screen's would.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import nats.errors
import nats.js.errors

from flywheel.contract import events
from flywheel.contract.bus import Bus, Consumer, Handler, wait_at_most
from flywheel.contract.runs import task_durable
from flywheel.contract.settings import InferenceSettings

log = logging.getLogger(__name__)

SCREEN = "inference"  # the screen's durable; a run's is task_durable(run): inference-<run>
CHECK_S = 1.0  # how often the consumers of ended runs are checked for what their durables still hold


def durable_of(run: str) -> str:
    """The durable of ``run``'s tasks (:func:`flywheel.contract.runs.task_durable`: ``flywheel run``
    looks for it when the run waits)."""
    return task_durable(run)


class RunTasks:
    """The task consumers of one inference process: the screen, and one consumer per run that
    goes on (see the module docstring). ``handle``: a run's task (rolled out); ``screen``: every
    task (refused, or acked for its run's consumer)."""

    def __init__(self, bus: Bus, config: InferenceSettings, handle: Handler, screen: Handler) -> None:
        self.bus = bus
        self.config = config
        self._handle = handle
        self._screen = screen
        self._running: dict[str, tuple[Consumer, asyncio.Future[None]]] = {}
        self._ending: dict[str, bool] = {}  # runs that ended, whose consumer drains: run -> finished
        self._failure: BaseException | None = None
        self._stopping = False

    def screen(self) -> Consumer:
        return self._consumer(SCREEN, None, self._screen)

    def runs(self) -> list[str]:
        """The runs whose tasks are consumed here now."""
        return list(self._running)

    def serve(self, run: str) -> None:
        """Consume ``run``'s tasks here (it goes on): its consumer starts, unless it runs."""
        self._ending.pop(run, None)
        if run in self._running or self._stopping:
            return
        consumer = self._consumer(durable_of(run), f"tasks.{run}.>", self._handle,
                                  recreate_if=lambda: run not in self._ending)  # an ended run's goes
        running = asyncio.ensure_future(consumer.run())
        running.add_done_callback(functools.partial(self._ended, run))
        self._running[run] = (consumer, running)
        log.info("run %s: its tasks are consumed here (durable %s)", run, durable_of(run))

    def end(self, run: str, finished: bool) -> None:
        """``run`` ended: its consumer stops once its durable holds nothing more (deleted with it
        when the run ``finished``)."""
        if run in self._running:
            self._ending[run] = finished

    def drain(self, run: str, finished: bool) -> None:
        """``run`` ended and has tasks on the bus: its consumer runs until its durable holds nothing
        more (its leftover tasks skipped and counted), started if it does not run here."""
        self.serve(run)
        self.end(run, finished)

    async def run(self, stopping: asyncio.Event) -> None:
        """Stop the consumers of ended runs as their durables empty, until ``stopping``; then stop
        them all. Raises what a run's consumer died of."""
        try:
            while not stopping.is_set() and self._failure is None:
                await wait_at_most(stopping.wait(), CHECK_S)
                for run, finished in list(self._ending.items()):
                    if await self._drained(run) and self._ending.get(run) == finished:
                        await self._stop(run, delete=finished)
        finally:
            self._stopping = True
            await asyncio.gather(*(self._stop(run, delete=False) for run in list(self._running)))
        if self._failure is not None:
            raise self._failure

    def _consumer(self, durable: str, subjects: str | None, handler: Handler,
                  recreate_if: Callable[[], bool] | None = None) -> Consumer:
        c = self.config
        return Consumer(self.bus, stream="TASKS", durable=durable, filter_subject=subjects, handler=handler,
                        event_type=events.Task, max_in_flight=c.max_tasks_in_flight, ack_wait_s=c.ack_wait_s,
                        max_deliver=c.max_deliver, backoff_s=c.backoff_s, grace_s=c.grace_s,
                        letters_undecodable=subjects is None,  # the screen letters what does not decode
                        recreate_if=recreate_if)

    def _ended(self, run: str, future: asyncio.Future[None]) -> None:
        """A run's consumer returned: an error stops the process."""
        if future.cancelled() or future.exception() is None:
            return
        log.error("run %s: its task consumer failed", run, exc_info=future.exception())
        self._failure = self._failure or future.exception()

    async def _drained(self, run: str) -> bool:
        """Whether ``run``'s durable holds nothing: no task queued, none delivered and not done,
        over every replica."""
        try:
            info = await self.bus.js.consumer_info("TASKS", durable_of(run))
        except nats.js.errors.NotFoundError:  # another replica deleted it
            return True
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("run %s: could not read its task durable (%s); asking again", run, exc)
            return False
        return not info.num_pending and not info.num_ack_pending

    async def _stop(self, run: str, delete: bool) -> None:
        found = self._running.pop(run, None)
        self._ending.pop(run, None)
        if found is None:
            return
        consumer, running = found
        consumer.stop()
        await asyncio.gather(running, return_exceptions=True)
        if not delete:
            log.info("run %s: its tasks are no longer consumed here", run)
            return
        try:
            await self.bus.js.delete_consumer("TASKS", durable_of(run))
        except nats.js.errors.NotFoundError:  # another replica deleted it
            pass
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("run %s: finished, but its task durable %s could not be deleted (%s); it holds nothing, "
                        "`nats consumer rm TASKS %s` removes it", run, durable_of(run), exc, durable_of(run))
            return
        log.info("run %s: finished, its tasks done with: its durable %s is deleted", run, durable_of(run))
