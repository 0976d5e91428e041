"""Runs named by incoming tasks: created in the run-state KV bucket on first sight, refused
when they belong to another tenant or have ended.

The run-state bucket (:meth:`flywheel.contract.bus.Bus.runs_kv`) is the source of truth of a run's
tenant and status; the trace store's ``runs`` table copies it. A run belongs to the tenant
that named it first, and a task for it from another tenant is refused (:class:`RunConflict`,
409). A run that has ended (:func:`flywheel.contract.runs.end_of`: finished, failed, stopped, or
abandoned by its owner) takes no more tasks (:class:`RunEnded`, 409), and neither does a run
whose state does not decode (:class:`flywheel.contract.runs.BadRunState`, 409).

Every request reads each run it names once from the bucket (a run's status changes while
it lives, so it is never cached); runs already copied into the store are remembered for the
life of the process, so the store is written only for new ones. Not covered: authentication
(the tenant is whatever the request says), deleting runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.runs import BadRunState, RunConflict, end_of, get_or_create_run, get_run
from flywheel_gateway.store import Store

__all__ = ["BadRunState", "RunConflict", "RunEnded", "RunRegistry"]


class RunEnded(RunConflict):
    """The run has ended: it takes no more tasks."""


class RunRegistry:
    def __init__(self, bus: Bus, store: Store) -> None:
        self.bus = bus
        self.store = store
        self._stored: set[str] = set()  # runs already copied into the store

    async def admit(self, runs: Iterable[str], tenant: str) -> None:
        """Check every run of a request before any task of it is published: refuse another
        tenant's runs and ended ones; then create the runs not yet in the bucket, owned by
        ``tenant``. Nothing is created when a run is refused."""
        states: dict[str, events.RunState] = {}
        missing: list[str] = []
        for run in sorted(set(runs)):
            state = await get_run(self.bus, run)  # BadRunState propagates: a 409
            if state is None:
                missing.append(run)
            else:
                _check(state, tenant)
                states[run] = state
        for run in missing:
            state, _ = await get_or_create_run(self.bus, run, tenant)
            _check(state, tenant)  # another request may have created it meanwhile
            states[run] = state
        unstored = [state for run, state in states.items() if run not in self._stored]
        if unstored:
            await self.store.upsert_runs(unstored)
            self._stored.update(state.id for state in unstored)


def _check(state: events.RunState, tenant: str) -> None:
    if state.tenant != tenant:
        raise RunConflict(f"run {state.id!r} belongs to tenant {state.tenant!r}, not {tenant!r}; "
                          "name another run or send the Flywheel-Tenant header of its owner")
    end = end_of(state)
    if end is not None:
        raise RunEnded(f"{end.reason}; it takes no more tasks: publish them to a new run (another run id), which "
                       "`flywheel run` or the first task naming it registers")
