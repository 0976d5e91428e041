"""Every run's current state, as the inference worker knows it, and whether the run ended.

The states come from a watcher on the runs bucket (:func:`flywheel.contract.runs.watch_runs`),
kept here by run; a task is checked against them when it arrives
(:func:`flywheel.contract.runs.end_of`). A run ends when it finished, failed or was stopped, or
when it was abandoned: its owner's lease expired. Nothing writes the state when an owner dies,
so a lapse is read off the kept state and the clock, and counts only once a fresh read of the
bucket confirms it (:meth:`RunStates.confirm_lapse`): after this process was paused (SIGSTOP, a
VM pause, a long GC, a cut link) the kept state and the clock say every lease lapsed while the
owners went on renewing them, and the watcher has not caught up.

A task whose run is not in the bucket, has no config, or whose state does not decode can never
be taken (a run is registered with its config before its tasks are published, so waiting
cannot help): :meth:`RunStates.current` refuses it (Reject) with the reason. What follows from a
run's state (its task consumer, its hosting) is for the worker's other parts
(:mod:`flywheel_inference.intake`, :mod:`flywheel_inference.hosting`).
"""

from __future__ import annotations

import logging
from datetime import datetime

import nats.errors

from flywheel.contract import events
from flywheel.contract.bus import RUNS_BUCKET, Bus, Reject
from flywheel.contract.runs import BadRunState, RunEnd, end_of, get_run

log = logging.getLogger(__name__)


class RunStates:
    """Every run's current state (kept by the watcher, or read again where that matters), and how
    each ended."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.by_run: dict[str, events.RunState] = {}  # every run's current state, kept by the watcher
        # Runs whose expired lease a fresh read confirmed: the updated_at of the state it read.
        self._lapse_confirmed: dict[str, datetime] = {}

    def get(self, run: str) -> events.RunState | None:
        return self.by_run.get(run)

    def keep(self, state: events.RunState) -> None:
        """The watcher's newest state of its run."""
        self.by_run[state.id] = state

    def end(self, run: str) -> RunEnd | None:
        """How the run ended by its kept state (None: it goes on). An expired lease counts only once
        a fresh read of the bucket confirmed it (:meth:`confirm_lapse`)."""
        state = self.by_run.get(run)
        end = end_of(state) if state is not None else None
        if state is not None and end is not None and end.status == "abandoned" \
                and self._lapse_confirmed.get(run) != state.updated_at:
            return None
        return end

    async def confirm_lapse(self, run: str) -> None:
        """Re-read the run's state from the bucket when its kept one says its lease lapsed and no
        read confirmed that yet; the fresh state is kept (a renewed lease: the run goes on)."""
        state = self.by_run.get(run)
        end = end_of(state) if state is not None else None
        if state is None or end is None or end.status != "abandoned":
            return
        if self._lapse_confirmed.get(run) == state.updated_at:
            return
        try:
            fresh = await get_run(self.bus, run)
        except (BadRunState, nats.errors.Error, TimeoutError) as exc:
            log.warning("run %s: its lease looks expired, and its state could not be read again to confirm it (%s); "
                        "nothing is released until it can", run, exc)
            return
        if fresh is None:
            return
        if fresh.updated_at >= state.updated_at:
            self.by_run[run] = state = fresh
        if end_of(state) is not None:
            self._lapse_confirmed[run] = state.updated_at

    def keep_read(self, run: str, state: events.RunState) -> bool:
        """Keep ``state``, the run's just read from the bucket, unless the kept one is newer (the
        watcher may not have seen a resume yet); an end it shows is confirmed. Whether it was kept."""
        cached = self.by_run.get(run)
        if cached is not None and cached.updated_at > state.updated_at:
            return False
        self.by_run[run] = state
        if end_of(state) is not None:
            self._lapse_confirmed[run] = state.updated_at  # read just now
        return True

    async def current(self, run: str, fresh: bool = False) -> events.RunState:
        """The run's current state (the watcher's; read from the bucket when ``fresh`` or when
        the watcher has none with a config yet); Reject when the run cannot take tasks, and
        never will."""
        state = self.by_run.get(run)
        if state is not None and state.config and not fresh:
            return state
        try:
            state = await get_run(self.bus, run)
        except BadRunState as exc:
            raise Reject(f"{exc}; inference cannot tell the run's model and sampling") from None
        if state is None:
            raise Reject(f"run {run!r} is not in the runs bucket ({RUNS_BUCKET}): publish tasks to a run that "
                         "`flywheel run CONFIG` registered (it writes the run's config before its tasks)")
        if not state.config:
            raise Reject(f"run {run!r} has no config (RunState.config is empty), so inference does not know its "
                         "model and sampling: publish tasks to a run that `flywheel run CONFIG` registered "
                         "(it writes the run's config before its tasks)")
        return state
