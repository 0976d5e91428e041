"""Runs named by incoming tasks: created in the run-state KV bucket on first sight.

The run-state bucket (:meth:`flywheel.bus.Bus.runs_kv`) is the source of truth of a run's
tenant; the trace store's ``runs`` table copies it. A run belongs to the tenant that named
it first, and a task for it from another tenant is refused.

Known runs are cached for the life of the process (a run's tenant never changes), so a
POST of tasks for a known run costs no KV round trip. Not covered: authentication (the
tenant is whatever the request says), deleting runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from flywheel.bus import Bus
from flywheel.runs import RunConflict, get_or_create_run
from flywheel_gateway.store import Store

__all__ = ["RunConflict", "RunRegistry"]


class RunRegistry:
    def __init__(self, bus: Bus, store: Store) -> None:
        self.bus = bus
        self.store = store
        self._tenants: dict[str, str] = {}  # run id -> tenant

    async def ensure(self, runs: Iterable[str], tenant: str) -> None:
        """Create the runs not yet in the bucket, owned by ``tenant``; refuse another tenant's runs."""
        wanted = sorted(set(runs))
        new = [run for run in wanted if run not in self._tenants]
        if new:
            states = [(await get_or_create_run(self.bus, run, tenant))[0] for run in new]
            await self.store.upsert_runs(states)
            self._tenants.update((state.id, state.tenant) for state in states)
        for run in wanted:
            if self._tenants[run] != tenant:
                raise RunConflict(f"run {run!r} belongs to tenant {self._tenants[run]!r}, not {tenant!r}; "
                                  "name another run or send the Flywheel-Tenant header of its owner")
