"""The runs this inference process hosts: each run's config, policy and admission, its weights
kept current, and the snapshots the API serves as ``RUN@STEP``.

- Each run named by a task (or by a request to the API) gets a :class:`HostedRun` on first
  sight: its config (from the runs KV bucket, read once), its policy (the run's model, loaded
  once: :mod:`flywheel_inference.policies`) and its admission counters
  (:mod:`flywheel_inference.admission`). No rollout is sampled before the run's first weights
  (version 0, published by the trainer after any warm-up) are loaded, so inference and trainer
  start from the same weights.
- A run of kind ``eval`` with a config is a model served for ``flywheel eval --model NAME``
  (:mod:`flywheel.ops.evalmodel`): hosted from its config's model as any run, but no trainer
  publishes its weights, so its policy serves the model's own as version 0; once the eval run
  ended and nothing sampled from it for ``EVICT_IDLE_S``, it is unloaded. An ended LoRA run's
  adapter leaves its shared base alike, once its rollouts are done too.
- Weight updates come from an ordered consumer on WEIGHTS (:func:`flywheel.contract.bus.watch`)
  that starts at the last message of every run's subject, so each replica sees every update
  and a late one catches up; a payload there that is not an update of that run (garbage,
  another event, another run's update) is skipped and dead-lettered once (the same letter from
  every replica and restart). A run hosted before any update of it was seen (the last message
  on its subject was not one) reads its subject from the start for its last real update. The
  run's policy loads the newest update; once loaded, the update advances the run's admission
  bound, and the run's rollouts that can no longer be trained stop (:meth:`HostedRun.stop_stale`).
  A bogus update (a blob that does not verify) leaves the run on its weights
  (:mod:`flywheel_inference.policy`). What the admission reads of an update are its typed
  fields (``version``, ``num_unused_total``), never its ``metrics``, which are the step's
  figures for people.
- When a run ends (:mod:`flywheel_inference.run_states`), its admission releases its waiting
  tasks (:meth:`Hosting.check_end`). The heartbeat's counters (``runs``, ``shared_bases``) are
  written here.

A rollout holds a place of its run and one of its tenant's (``tenant_max_rollouts_in_flight``,
over the tenant's runs in this process).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.contract import events, metrics, weights
from flywheel.contract.bus import Bus, EventCount, watch
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import end_of, get_run
from flywheel.contract.settings import InferenceSettings
from flywheel_inference.admission import Admission, SharedIssued, TenantPlaces
from flywheel_inference.interception import Session
from flywheel_inference.once import once
from flywheel_inference.policies import BuildBackend, Policies
from flywheel_inference.policy import MAX_OFFERED, Policy
from flywheel_inference.run_states import RunStates

log = logging.getLogger(__name__)

WEIGHTS_WATCHER = "inference-weights"  # the weights watcher's name on its dead letters
# An ended LoRA run's adapter leaves the shared base once nothing has sampled from it for this long
# (the API may still serve the run's last weights: a burst of eval requests keeps it loaded).
EVICT_IDLE_S = 30.0


class UnknownRun(LookupError):
    """No run of this id in the runs KV bucket."""


@dataclass
class HostedRun:
    config: RunConfig
    policy: Policy
    admission: Admission
    # The run's rollouts being rolled out: their sessions and how to stop them.
    live: dict[str, tuple[Session, asyncio.Future[str]]] = field(default_factory=dict)

    def stop_stale(self) -> None:
        """Stop the rollouts that can no longer be trained: one of their model calls was sampled by
        weights more than ``max_off_policy_steps`` behind the ones now loaded, so the trainer
        would drop them on arrival (and counts them as stale): their places and the budget they
        hold come back now, not when a slow environment is done with them."""
        loaded, bound = self.policy.version, self.config.trainer.max_off_policy_steps
        if loaded is None:
            return
        for session, stop in self.live.values():
            if session.versions and loaded - min(session.versions) > bound and not stop.done():
                stop.set_result(f"stale: sampled by weights version {min(session.versions)}, version {loaded} is "
                                f"loaded and trainer.max_off_policy_steps = {bound}; the trainer would drop it")

    @property
    def sampling(self) -> events.Sampling:
        s = self.config.sampling
        return events.Sampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, stop=list(s.stop))

    def counters(self) -> dict[str, Any]:
        return {"policy_version": self.policy.version, "weights_error": self.policy.load_error,
                **self.admission.counters()}


class Hosting:
    """The hosted runs and snapshots of this process. ``info``: the heartbeat's, whose ``runs``
    and ``shared_bases`` are kept current here."""

    def __init__(self, bus: Bus, build: BuildBackend, config: InferenceSettings, states: RunStates,
                 info: dict[str, Any], trusted_modules: Sequence[str] = ()) -> None:
        self.bus = bus
        self.config = config
        self.states = states
        self.info = info
        self.trusted_modules = trusted_modules
        self.policies = Policies(bus, build, on_change=self.refresh_info)
        self.runs: dict[str, HostedRun] = {}
        self._starting: dict[str, asyncio.Future[HostedRun]] = {}
        self.snapshots: OrderedDict[tuple[str, int], HostedRun] = OrderedDict()  # (run, step), least recent first
        self._loading: dict[tuple[str, int], asyncio.Future[HostedRun]] = {}
        self._updates: dict[str, dict[int, events.WeightUpdate]] = {}  # newest few per run not hosted yet
        self._num_skipped: dict[str, int] = {}  # rollouts of skipped tasks of runs not hosted here
        self._info_due = False  # a write of the counters is scheduled (refresh_info)
        self._rollouts_on_bus: dict[str, EventCount] = {}  # by run: its rollouts in the ROLLOUTS stream
        self._tenants: dict[str, TenantPlaces] = {}  # each tenant's rollout places in this process
        # This process among the replicas that share each run's admission bound (SharedIssued).
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"

    async def close(self) -> None:
        for starting in self._starting.values():
            starting.cancel()
        for loading in self._loading.values():
            loading.cancel()
        await asyncio.gather(*(hosted.policy.close() for hosted in [*self.runs.values(), *self.snapshots.values()]))
        for hosted in self.runs.values():
            if hosted.admission.shared is not None:
                await hosted.admission.shared.close()
        await self.policies.close()

    # --- runs ---------------------------------------------------------------------------------

    async def run_config(self, run: str) -> RunConfig:
        state = await get_run(self.bus, run)
        if state is None:
            raise UnknownRun(f"run {run!r} is not in the runs bucket")
        if not state.config:
            raise ValueError(f"run {run!r} has no config yet (RunState.config is empty); `flywheel run` writes it")
        return RunConfig.parse(state.config, source=f"run {run!r} config", trusted_modules=self.trusted_modules)

    async def hosted(self, run: str) -> HostedRun:
        """The run's config, policy and admission counters, built on first use (once)."""
        if run in self.runs:
            return self.runs[run]
        return await once(self._starting, run, lambda: self._start(run))

    async def _start(self, run: str) -> HostedRun:
        cfg = await self.run_config(run)
        num_issued = await self._num_rollouts_published(run)
        shared = SharedIssued(self.bus, run, self.replica, self._num_rollouts_published)
        await self.states.confirm_lapse(run)
        state = self.states.get(run) or await get_run(self.bus, run)
        tenant = state.tenant if state is not None else events.RunState(id=run).tenant
        if tenant not in self._tenants:
            self._tenants[tenant] = TenantPlaces(tenant, self.config.tenant_max_rollouts_in_flight)
        admission = Admission.for_run(cfg, num_issued=num_issued, on_change=self.refresh_info, shared=shared,
                                      tenant=self._tenants[tenant])
        admission.num_skipped = self._num_skipped.pop(run, 0)
        if self.states.get(run) is not None:
            end = self.states.end(run)
        else:
            end = end_of(state) if state is not None else None
        admission.ended = end.reason if end is not None else None

        async def loaded(update: events.WeightUpdate) -> None:
            await admission.loaded(update)
            if run in self.runs:
                self.runs[run].stop_stale()
            self.refresh_info()  # the policy version, even when the admission bound stays

        policy = await self.policies.policy(run, cfg, on_loaded=loaded, on_error=lambda _: self.refresh_info())
        hosted = HostedRun(cfg, policy, admission)
        self.runs[run] = hosted
        if state is not None and state.kind == "eval":
            # An eval's model: no trainer publishes its weights; it is served as its folder holds it.
            policy.serve_as_built()
            self.refresh_info()
            return hosted
        self.refresh_info()
        seen = self._updates.pop(run, {})
        for update in sorted(seen.values() or await weights.updates(self.bus, run, MAX_OFFERED),
                             key=lambda u: u.version):
            policy.offer(update)
        return hosted

    def skip(self, run: str, num_rollouts: int) -> None:
        """Count the rollouts of a skipped task of ``run`` (kept until the run is hosted, if it is not)."""
        if run in self.runs:
            self.runs[run].admission.skip(num_rollouts)
        else:
            self._num_skipped[run] = self._num_skipped.get(run, 0) + num_rollouts
            self.refresh_info()

    async def check_end(self, run: str) -> None:
        """Tell the run's admission whether it ended (its waiting tasks are released); unload an
        ended eval's model, or evict an ended LoRA run's adapter, once idle."""
        hosted, state = self.runs.get(run), self.states.get(run)
        if hosted is None or state is None:
            return
        end = self.states.end(run)
        reason = end.reason if end is not None else None
        if reason != hosted.admission.ended:
            log.info("run %s: %s", run, f"{reason}; its waiting tasks are released" if reason else "takes tasks again")
        await hosted.admission.set_ended(reason)
        idle_s = time.monotonic() - hosted.policy.last_used
        if reason is not None and state.kind == "eval" and not hosted.live and idle_s >= EVICT_IDLE_S:
            # An ended eval's model (``flywheel eval --model NAME``) is unloaded; asked for again, it loads again.
            del self.runs[run]
            log.info("run %s: the eval has ended; its model is unloaded", run)
            await self.policies.close_policy(hosted.policy)
            return
        if reason is not None and hosted.policy.adapter is not None and not hosted.live and idle_s >= EVICT_IDLE_S:
            # An ended LoRA run gives its place on the shared base back; it is hosted again
            # (its last adapter loaded) if it is resumed or asked for on the API.
            del self.runs[run]
            log.info("run %s: its adapter is evicted from the shared base", run)
            await self.policies.close_policy(hosted.policy)

    async def _num_rollouts_published(self, run: str) -> int:
        """The run's rollouts in the ROLLOUTS stream (a group's batch counts its rollouts)."""
        if run not in self._rollouts_on_bus:
            self._rollouts_on_bus[run] = EventCount(self.bus, "ROLLOUTS", f"rollouts.{run}.>")
        return await self._rollouts_on_bus[run].now()

    # --- snapshots ----------------------------------------------------------------------------

    async def served(self, model: str) -> HostedRun:
        """What ``model`` names on the OpenAI API: ``RUN``, the run's policy (a finished run's:
        its last weights), or ``RUN@STEP``, the weights of trainer step STEP, while the run keeps
        them (the newest few, and those its evals are pinned to) in a policy of its own that no
        update moves (:meth:`snapshot`)."""
        run, at, step = model.partition("@")
        if not at:
            return await self.hosted(run)
        if not step.isdigit():
            raise ValueError(f"{model!r}: write RUN@STEP with STEP a trainer step number, e.g. {run}@10")
        return await self.snapshot(run, int(step))

    async def snapshot(self, run: str, step: int) -> HostedRun:
        """The run's weights at trainer ``step``, loaded once into a backend of their own and
        kept, the ``snapshots_kept`` most recently used of them (an older one is closed)."""
        key = (run, step)
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return self.snapshots[key]
        return await once(self._loading, key, lambda: self._load_snapshot(run, step))

    async def _load_snapshot(self, run: str, step: int) -> HostedRun:
        cfg = await self.run_config(run)
        updates = await weights.kept_updates(self.bus, await weights.updates(self.bus, run))
        matching = [u for u in updates if u.trainer_step == step]
        if not matching:
            steps = sorted({u.trainer_step for u in updates})
            raise UnknownRun(f"run {run!r} keeps no weights of step {step} (it keeps those of steps "
                             f"{', '.join(map(str, steps)) or 'none'}); `flywheel export {run} --step N DIR` "
                             "writes a kept checkpoint as a model folder")
        update = max(matching, key=lambda u: u.version)
        log.info("run %s: loading the weights of step %d (version %d) to serve as %s@%d", run, step, update.version,
                 run, step)
        policy = await self.policies.policy(f"{run}@{step}", cfg)
        try:
            await policy.load(update)
        except BaseException:
            await policy.close()
            raise
        snapshot = HostedRun(cfg, policy, Admission.for_run(cfg, num_issued=0))
        self.snapshots[run, step] = snapshot
        while len(self.snapshots) > self.config.snapshots_kept:
            _, dropped = self.snapshots.popitem(last=False)
            await self.policies.close_policy(dropped.policy)
        return snapshot

    # --- weights ------------------------------------------------------------------------------

    async def on_weight_update(self, update: events.WeightUpdate) -> None:
        if update.run in self.runs:
            self.runs[update.run].policy.offer(update)
            return
        seen = self._updates.setdefault(update.run, {})  # offered when the run is hosted: the last few
        seen.pop(update.version, None)
        seen[update.version] = update
        while len(seen) > MAX_OFFERED:
            del seen[next(iter(seen))]

    async def watch_weights(self, stopping: asyncio.Event) -> None:
        """Every weight update of every run, from the last message per run on, until ``stopping``;
        what is not an update of its subject's run is skipped and dead-lettered once."""
        async for update in watch(self.bus, "weights.>", events.WeightUpdate, stopping, watcher=WEIGHTS_WATCHER,
                                  last_per_subject=True):
            await self.on_weight_update(update)

    # --- the heartbeat's counters -------------------------------------------------------------

    def refresh_info(self) -> None:
        """Keep the heartbeat's counters current. Called on every change of a run's counters (a
        rollout makes three), it writes them once per turn of the event loop, however many
        changes the turn made: writing them is not free, and nothing reads them within a turn."""
        if not self._info_due:
            self._info_due = True
            asyncio.get_running_loop().call_soon(self._write_info)

    def _write_info(self) -> None:
        self._info_due = False
        runs: dict[str, Any] = {run: {"num_skipped": n} for run, n in self._num_skipped.items()}
        self.info["runs"] = runs | {run: hosted.counters() for run, hosted in self.runs.items()}
        for run, hosted in self.runs.items():
            admission = hosted.admission
            for counter, value in (("issued", admission.num_issued), ("in_flight", admission.num_in_flight),
                                   ("waiting", admission.num_waiting), ("max_issued", admission.max_issued)):
                metrics.ADMISSION.labels(run, counter).set(value)
        self.info["shared_bases"] = self.policies.counters()

