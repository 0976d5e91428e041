"""The orchestrator service: claims the runs that need an owner and runs a :class:`RunOwner` for each.

Every ``SCAN_S``, and at once when a run becomes claimable (a watch on the bucket), it reads
the run-state bucket: a training run with a config that is not ended and has no live owner
(new, resumed, or left by an owner whose lease ran out: :func:`flywheel.contract.runs.claimable`)
is claimed by compare-and-set, so of several orchestrators one wins. Its heartbeat's
``info`` lists the runs it owns. On SIGTERM or SIGINT every owner stops its trainer (which
checkpoints first) and lets go of its run, left ``running``: the next orchestrator to start
claims it and goes on. ``--run-config`` registers (or resumes) a deployment's runs at start
(:func:`submit`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import nats.errors

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import (
    add_note,
    claim_run,
    claimable,
    end_of,
    list_runs,
    register_run,
    release_run,
    resume_run,
    watch_runs,
)
from flywheel.contract.service import Service
from flywheel.contract.settings import Settings
from flywheel.runtime.environments import WorkerPool
from flywheel.runtime.runs import config_ids, prepare_run
from flywheel.runtime.supervise import trainer_env
from flywheel.sdk.sandbox import SandboxClient
from flywheel.sdk.scoring import reward_definition
from flywheel_orchestrator.owner import RunOwner

log = logging.getLogger(__name__)

SERVICE_NAME = "orchestrator"
SCAN_S = 1.0  # how often the run-state bucket is read for runs that need an owner


class Orchestrator:
    def __init__(self, bus: Bus, settings: Settings, service: Service, pool: WorkerPool) -> None:
        """``pool``: the environment workers the runs' task sets and evals run in."""
        self.bus = bus
        self.settings = settings
        self.service = service
        self.pool = pool
        self.owners: dict[str, tuple[RunOwner, asyncio.Task[None]]] = {}

    @property
    def name(self) -> str:
        return f"orchestrator {self.service.instance}"

    async def serve(self, stopping: asyncio.Event) -> None:
        wake = asyncio.Event()  # a run became claimable: scan now (a new run is claimed at once)

        async def changed(state: events.RunState) -> None:
            if state.id not in self.owners and claimable(state):
                wake.set()

        watching = asyncio.ensure_future(watch_runs(self.bus, stopping, changed))
        try:
            while not stopping.is_set():
                wake.clear()
                try:
                    await self._scan()
                except (TimeoutError, nats.errors.Error) as exc:
                    log.warning("reading the runs failed (%s: %s); trying again", type(exc).__name__, exc)
                waiters = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(wake.wait())]
                await asyncio.wait(waiters, timeout=SCAN_S, return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            for owner, _ in self.owners.values():
                owner.stopping.set()
            await asyncio.gather(*(task for _, task in self.owners.values()), return_exceptions=True)

    async def _scan(self) -> None:
        for run, (_, task) in list(self.owners.items()):
            if task.done():
                del self.owners[run]
                self._refresh_info()
        for state in await list_runs(self.bus):
            if state.id in self.owners or not claimable(state):
                continue
            claimed = await claim_run(self.bus, state.id, self.name, self.settings.run_lease_s)
            if claimed is None:
                continue  # another orchestrator was first, or it ended meanwhile
            try:
                slots = {o.metrics_slot for o, _ in self.owners.values()}
                slot = min(set(range(len(slots) + 1)) - slots)
                owner = RunOwner(self.bus, self.settings, claimed, self.name, self.pool, slot)
            except ValueError as exc:  # its stored config no longer parses: said on the run, which is failed
                await self._refuse(claimed.id, str(exc))
                continue
            log.info("run %s: claimed (step %d)", claimed.id, claimed.trainer_step)
            self.owners[claimed.id] = (owner, asyncio.ensure_future(owner.run()))
            self._refresh_info()

    async def _refuse(self, run: str, why: str) -> None:
        await add_note(self.bus, run, f"{self.name} cannot run it: {why}")
        await release_run(self.bus, run, self.name, status="failed", ended_at=events.utc_now(), reason=why)

    def _refresh_info(self) -> None:
        self.service.info["runs"] = sorted(self.owners)


async def submit(bus: Bus, pool: WorkerPool, path: str, trusted_modules: Sequence[str] = ()) -> None:
    """Own the run of the config at ``path`` from the start (``--run-config``): registered when new,
    made claimable again when it stopped, failed or was abandoned; left alone otherwise."""
    given = RunConfig.from_toml(path, trusted_modules)
    cfg, environments = await prepare_run(pool, given, tenant=given.tenant)
    config = cfg.model_dump()
    scorers, env_scorers = reward_definition(cfg, environments)
    state, created = await register_run(bus, cfg.run, cfg.tenant, config=config, scorers=scorers,
                                        env_scorers=env_scorers, env_ids=config_ids(environments))
    if created:
        log.info("run %s: registered from %s", cfg.run, path)
    elif state.config != config:
        raise ValueError(f"--run-config {path}: run {cfg.run!r} exists with another config; name a new run in it")
    elif state.status != "finished" and end_of(state) is not None:
        await resume_run(bus, cfg.run)
        log.info("run %s: resumed from %s", cfg.run, path)


async def run(settings: Settings, run_configs: Sequence[str] = ()) -> None:
    """Composition root: bus, environment workers, the runs given, service, orchestrator; runs until a signal."""
    trainer_env(settings)  # the trainers' login is there (a ValueError says what to set)
    bus = await Bus.for_settings(settings, SERVICE_NAME)
    pool = WorkerPool(settings.workers, settings.data_dir, name=SERVICE_NAME, sandbox=SandboxClient(bus))
    try:
        for path in run_configs:
            await submit(bus, pool, path, settings.trusted_modules)
        service = Service(SERVICE_NAME, bus, info={"runs": [], "workers": pool.info})
        orchestrator = Orchestrator(bus, settings, service, pool)
        service.add_task(orchestrator.serve)
        await service.run()
    finally:
        await pool.close()
