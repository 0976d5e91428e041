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

import nats.js.errors
from nats.js.kv import KeyValue

from flywheel import events
from flywheel.bus import Bus
from flywheel_gateway.store import Store


class RunConflict(ValueError):
    """A task names a run that belongs to another tenant."""


class RunRegistry:
    def __init__(self, bus: Bus, store: Store) -> None:
        self.bus = bus
        self.store = store
        self._decoder = events.Decoder(events.RunState)
        self._tenants: dict[str, str] = {}  # run id -> tenant

    async def ensure(self, runs: Iterable[str], tenant: str) -> None:
        """Create the runs not yet in the bucket, owned by ``tenant``; refuse another tenant's runs."""
        wanted = sorted(set(runs))
        new = [run for run in wanted if run not in self._tenants]
        if new:
            kv = await self.bus.runs_kv()
            states = [await self._get_or_create(kv, run, tenant) for run in new]
            await self.store.upsert_runs(states)
            self._tenants.update((state.id, state.tenant) for state in states)
        for run in wanted:
            if self._tenants[run] != tenant:
                raise RunConflict(f"run {run!r} belongs to tenant {self._tenants[run]!r}, not {tenant!r}; "
                                  "name another run or send the Flywheel-Tenant header of its owner")

    async def _get_or_create(self, kv: KeyValue, run: str, tenant: str) -> events.RunState:
        for _ in range(2):  # a second pass only when another gateway created it meanwhile
            try:
                entry = await kv.get(run)
                if entry.value:
                    return self._decoder.decode(entry.value)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                pass  # not there yet: create it below
            state = events.RunState(id=run, tenant=tenant)
            try:
                await kv.create(run, events.encode(state))
                return state
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        raise RuntimeError(f"run {run!r}: the run-state key changed twice while it was being created")
