"""The inference worker: tasks in, trace nodes and rollouts out, weight updates applied.

:class:`Worker` is the composition root of the worker's parts, each a job of its own:

- :mod:`flywheel_inference.run_states`: every run's current state, and whether it ended;
- :mod:`flywheel_inference.hosting`: the runs hosted here (config, policy, admission), their
  weight updates, the ``RUN@STEP`` snapshots the API serves, the heartbeat's counters;
- :mod:`flywheel_inference.policies`: the models behind the policies, a base shared by LoRA runs;
- :mod:`flywheel_inference.intake`: the task consumers, following run states, and each delivery
  screened and handled once;
- :mod:`flywheel_inference.rollouts`: a task's group rolled out against interception sessions;
- :mod:`flywheel_inference.publishing`: the group onto the bus, counted as the bus stored it.

:meth:`Worker.service` runs them as one :class:`flywheel.contract.service.Service`: the TASKS
consumers, the weights and run-state watchers, the lease check.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.service import Service
from flywheel.contract.settings import InferenceSettings, WorkersSettings
from flywheel.runtime.environments import WorkerPool
from flywheel.sdk.sandbox import SandboxClient
from flywheel_inference.backends import build_backend
from flywheel_inference.completion import Backend
from flywheel_inference.hosting import HostedRun, Hosting
from flywheel_inference.intake import TaskIntake
from flywheel_inference.interception import Interception
from flywheel_inference.policies import BuildBackend
from flywheel_inference.rollouts import Rollouts
from flywheel_inference.run_states import RunStates


class Worker:
    def __init__(self, bus: Bus, build: BuildBackend, config: InferenceSettings, url: str | None = None,
                 pool: WorkerPool | None = None, trusted_modules: Sequence[str] = ()) -> None:
        """``config``: the settings' ``inference`` section. ``url``: where this process's HTTP
        server is reached (None: none); the programs of program harnesses reach their rollout's
        endpoint there through their sandbox's model relay. ``pool``: the environment workers
        harnesses, hooks and prompts run in (None: a pool of default settings). ``trusted_modules``:
        the setting, where a run config's parts by path may come from."""
        self.bus = bus
        self.config = config
        self.pool = pool or WorkerPool(WorkersSettings(), Path(".flywheel"), name="inference",
                                       sandbox=SandboxClient(bus))
        # the heartbeat's info: counters per run, environment workers
        self.info: dict[str, Any] = {"runs": {}, "url": url, "workers": self.pool.info}
        self.interception = Interception()
        self.states = RunStates(bus)
        self.hosting = Hosting(bus, build, config, self.states, self.info, trusted_modules)
        self.rollouts = Rollouts(bus, config, self.pool, self.interception, self.states, url)
        self.intake = TaskIntake(bus, config, self.states, self.hosting, self.rollouts)
        self.tasks = self.intake.tasks  # the screen and each run's task consumer

    @classmethod
    def with_backends(cls, bus: Bus, data_dir: Path, config: InferenceSettings, url: str | None = None,
                      workers: WorkersSettings | None = None, trusted_modules: Sequence[str] = ()) -> Worker:
        """A worker that builds each run's backend from its config (model resolved under ``data_dir``),
        its environments in workers of ``workers`` (None: the defaults)."""

        def build(cfg: RunConfig) -> Backend:
            from flywheel.sdk import models

            return build_backend(cfg.inference.backend, models.resolve_model(cfg.model.name, data_dir),
                                 cfg.model.dtype, lora=cfg.trainer.adapter is not None)

        pool = WorkerPool(workers or WorkersSettings(), data_dir, name="inference", sandbox=SandboxClient(bus))
        return cls(bus, build, config, url, pool, trusted_modules)

    def service(self, handle_signals: bool = True) -> Service:
        """The process's Service: the TASKS consumers (the screen, each run's), the weights and
        run-state watchers, the lease check."""
        service = Service("inference", self.bus, info=self.info, handle_signals=handle_signals)
        service.add(self.tasks.screen())
        service.add_task(self.tasks.run)
        service.add_task(self.hosting.watch_weights)
        service.add_task(self.intake.watch_runs)
        service.add_task(self.intake.watch_leases)
        return service

    async def close(self) -> None:
        await self.pool.close()
        await self.rollouts.close()
        await self.hosting.close()

    async def hosted(self, run: str) -> HostedRun:
        """The run's config, policy and admission counters (:meth:`Hosting.hosted`)."""
        return await self.hosting.hosted(run)

    async def served(self, model: str) -> HostedRun:
        """What ``model`` names on the OpenAI API (:meth:`Hosting.served`)."""
        return await self.hosting.served(model)
