"""The inference worker: tasks in, trace nodes and rollouts out, weight updates applied.

- Tasks come from a durable pull consumer on TASKS per run (``inference-<run>``), shared by
  every replica, behind a screen of every task (``inference``) that dead-letters what no run can
  take (:mod:`flywheel_inference.run_tasks`), within the bounds of the settings' ``inference``
  section (:class:`flywheel.contract.settings.InferenceSettings`). Their ack wait is short
  (``ack_wait_s``, 5 s; the bus layer sends ``in_progress``
  every third of it for a task still being worked on, so a long rollout is not
  redelivered): the tasks a killed replica held reach another one within seconds instead
  of blocking the run's ``max_ack_pending``. A task is rolled out ``num_rollouts``
  times as one group: the run's environment (loaded as every service loads it,
  :func:`flywheel.sdk.environment.load_for_run`) runs its harness once per rollout, each
  against its own interception URL (:mod:`flywheel_inference.interception`), which samples
  from the run's policy and publishes trace nodes as the calls complete (once the rollout
  has run `live_trace_after_s`; a shorter one's travel in its rollout only); the group's
  rollouts go out together when every harness has ended.
- Each run named by a task gets a :class:`HostedRun` on first sight: its config (from the
  runs KV bucket), its policy (the run's model, loaded once) and its admission counters.
  No rollout is sampled before the run's first weights (version 0, published by the
  trainer after any warm-up) are loaded, so inference and trainer start from the same
  weights.
- A run that trains an adapter (``trainer.adapter``) is hosted on the shared base of its
  model (:class:`SharedBase`: one backend per model, dtype and backend settings, loaded for
  the first such run): the run's policy is a view that loads its adapter there, and one
  batching loop takes every such run's requests, each row with its run's adapter
  (:mod:`flywheel_inference.adapters`). An ended run's adapter is evicted once nothing has
  sampled from it for ``EVICT_IDLE_S`` and its rollouts are done; the base goes with its
  last adapter. A backend that keeps no adapters side by side (one of the user's own) gets
  a copy per run, the adapter merged in. The heartbeat's ``shared_bases`` lists them.
- A run of kind ``eval`` with a config is a model served for ``flywheel eval --model NAME``
  (:mod:`flywheel.ops.evalmodel`): hosted from its config's model as any run, but no trainer
  publishes its weights, so its policy serves the model's own as version 0; once the eval run
  ended and nothing sampled from it for ``EVICT_IDLE_S``, it is unloaded.
- Run states come from a watcher on the runs bucket, which keeps every run's current
  state; a task is checked against it when it arrives (:func:`flywheel.contract.runs.end_of`).
  When a run ends (finished, failed, stopped, or abandoned: its owner's lease expired,
  which is checked every ``LEASE_CHECK_S`` since nothing writes the state when an owner
  dies), its waiting tasks are released at once (acked, counted as ``num_skipped``), and
  its consumer stops once its leftover tasks are skipped too.
- Weight updates come from an ordered consumer on WEIGHTS (:func:`flywheel.contract.bus.watch`)
  that starts at the last message of every run's subject, so each replica sees every
  update and a late one catches up; a payload there that is not an update of that run
  (garbage, another event, another run's update) is skipped and dead-lettered once (the
  same letter from every replica and restart). A run hosted before any update of it was
  seen (the last message on its subject was not one) reads its subject from the start
  for its last real update. The run's policy loads the newest update; once loaded, the
  update advances the run's admission bound. A bogus update (a blob that does not verify)
  leaves the run on its weights (:mod:`flywheel_inference.policy`). What the admission
  reads of an update are its typed fields (``version``, ``num_dropped_total``), never its
  ``metrics``, which are the step's figures for people.

Delivery is at least once (a server restart loses acks; a replica dies mid-task), and
budgets count what reached the bus, never attempts: rollout ids hash (task id, index), so
the bus keeps one copy of a group rolled out twice, and admission keeps only the rollouts
the bus stored (:mod:`flywheel_inference.admission`); this process remembers the tasks it
published (the last ``MAX_RECORDED_TASKS`` per run) and acks such a task again without
rolling it out, and a second delivery of a task still in flight here waits for the first
one's outcome instead of running it twice.

A task waiting for its run's admission holds one of its run's ``max_tasks_in_flight`` slots,
never another run's; a rollout holds a place of its run and one of its tenant's
(``tenant_max_rollouts_in_flight``, over the tenant's runs in this process). A run's config
is read once, when the run is first seen.

Failures: a task that can never succeed is dead-lettered at once with the reason: its run
is not in the runs bucket, has no config, or its state does not decode (a run is
registered with its config before its tasks are published, so waiting cannot help); it
was published after its run ended (these by the screen); its environment does not load; its row does not match
the task set's schema; bad sampling settings; a group larger than the admission bounds. A
task left over from before its run ended is acked and counted as skipped. Anything else
(the model fails to build, the bus fails) fails the delivery, which the bus retries with
backoff before dead-lettering it. A harness that raises, runs past ``rollout_timeout_s`` or
never calls the model gives a rollout with status ``error`` and the reason (scored, never
trained on); the service goes on: :mod:`flywheel.sdk.rollout` holds these rules, the same in
``flywheel eval``. A rollout that goes stale while it runs (weights are loaded that leave
one of its model calls more than ``max_off_policy_steps`` behind, typically while a slow
environment holds it) is stopped at once and published as an ``error`` saying so: the
trainer would drop it anyway, and counts it as stale; stopping it gives its place and its
budget back now (:meth:`HostedRun.stop_stale`). Not covered: the record of published tasks is per
process, so a task redelivered to another replica is rolled out again there (its copies
are dropped by the bus within its duplicate window, and not counted).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import PubAck

from flywheel.contract import events, metrics, weights
from flywheel.contract.bus import RUNS_BUCKET, Bus, Delivery, EventCount, Reject, wait_at_most, watch
from flywheel.contract.config import RunConfig
from flywheel.contract.heap import freeze_heap
from flywheel.contract.runs import BadRunState, RunEnd, end_of, get_run, watch_runs
from flywheel.contract.service import Service, compute
from flywheel.contract.settings import InferenceSettings, WorkersSettings
from flywheel.runtime.channel import RemoteError
from flywheel.runtime.environments import RolloutLink, WorkerEnvironment, WorkerError, WorkerPool
from flywheel.runtime.runs import load_for_run
from flywheel.sdk.environment import EnvironmentLoadError
from flywheel.sdk.rollout import Ran, conclude
from flywheel.sdk.sandbox import SandboxClient
from flywheel_inference.admission import Admission, RunEnded, SharedIssued, TenantPlaces
from flywheel_inference.backends import build_backend
from flywheel_inference.completion import Backend
from flywheel_inference.interception import Interception, Session
from flywheel_inference.policy import MAX_OFFERED, Batcher, OnLoaded, Policy, TransientFetchError
from flywheel_inference.run_tasks import RunTasks

log = logging.getLogger(__name__)

WEIGHTS_WATCHER = "inference-weights"  # the weights watcher's name on its dead letters
# Task ids whose group this process published, remembered per run: a redelivery comes
# within a few ack waits, so the last few thousand are plenty.
MAX_RECORDED_TASKS = 4096
LEASE_CHECK_S = 1.0  # how often hosted runs are checked for an expired owner's lease
# An ended LoRA run's adapter leaves the shared base once nothing has sampled from it for this long
# (the API may still serve the run's last weights: a burst of eval requests keeps it loaded).
EVICT_IDLE_S = 30.0


def _published_after(task: events.Task, end: RunEnd) -> bool:
    """Whether ``task`` was published after its run ended (not left over from before)."""
    created_at = task.created_at if task.created_at.tzinfo else task.created_at.replace(tzinfo=UTC)
    return created_at >= end.since


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


BuildBackend = Callable[[RunConfig], Backend]


@dataclass
class SharedBase:
    """One loaded base model shared by the LoRA runs on it: its backend (holding their
    adapters), one batching loop for all of them, and the names (runs, ``RUN@STEP``
    snapshots) whose adapters it holds."""

    model: str
    backend: Backend
    batcher: Batcher
    names: set[str] = field(default_factory=set)

    def counters(self) -> dict[str, Any]:
        slots = getattr(self.backend, "adapters", None)
        loaded = getattr(slots, "adapters", {})
        return {"model": self.model, "adapters": sorted(self.names),
                "adapter_bytes": sum(a.num_bytes for a in loaded.values())}


def _fetch_is_transient(exc: Exception) -> bool:
    """A fetch failure worth another try: the server restarting or slow. A blob that is missing
    or does not verify (ValueError) stays so."""
    if isinstance(exc, nats.js.errors.APIError):
        return isinstance(exc, nats.js.errors.ServiceUnavailableError)
    return isinstance(exc, (nats.errors.Error, TimeoutError, ConnectionError))


K = TypeVar("K")
T = TypeVar("T")


async def _once(pending: dict[K, asyncio.Future[T]], key: K, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``make()`` started once for ``key`` however many callers ask meanwhile; each waits for it
    (shielded: a caller that gives up does not cancel it for the others)."""
    if key not in pending:
        pending[key] = asyncio.ensure_future(make())
    future = pending[key]
    try:
        return await asyncio.shield(future)
    finally:
        if future.done():
            pending.pop(key, None)


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
        self.trusted_modules = trusted_modules
        self.url = url
        self.pool = pool or WorkerPool(WorkersSettings(), Path(".flywheel"), name="inference",
                                       sandbox=SandboxClient(bus))
        # the heartbeat's info: counters per run, environment workers
        self.info: dict[str, Any] = {"runs": {}, "url": url, "workers": self.pool.info}
        self._build = build
        self._runs: dict[str, HostedRun] = {}
        self._starting: dict[str, asyncio.Future[HostedRun]] = {}
        self._states: dict[str, events.RunState] = {}  # every run's current state, kept by watch_runs
        # Runs whose expired lease a fresh read confirmed: the updated_at of the state it read.
        self._lapse_confirmed: dict[str, datetime] = {}
        self._updates: dict[str, dict[int, events.WeightUpdate]] = {}  # newest few per run not hosted yet
        self._published: dict[str, OrderedDict[str, None]] = {}  # per run: tasks whose group went out
        self._in_flight: dict[tuple[str, str], asyncio.Event] = {}  # (run, task id) -> set when handled
        self._num_skipped: dict[str, int] = {}  # rollouts of skipped tasks of runs not hosted here
        self._environments: dict[tuple[str, str], WorkerEnvironment] = {}
        self._environments_loading: dict[tuple[str, str], asyncio.Future[WorkerEnvironment]] = {}
        self._snapshots: OrderedDict[tuple[str, int], HostedRun] = OrderedDict()  # (run, step), least recent first
        self._loading: dict[tuple[str, int], asyncio.Future[HostedRun]] = {}
        self._bases: dict[tuple[str, str, str], SharedBase] = {}  # (model, dtype, backend) -> its LoRA runs' base
        self._base_loading: dict[tuple[str, str, str], asyncio.Future[SharedBase | Backend]] = {}
        self.interception = Interception()
        self._asgi_client: Any = None
        self._in_process: Any = None  # the in-process transport behind _asgi_client
        self._info_due = False  # a write of the counters is scheduled (_refresh_info)
        self._rollouts_on_bus: dict[str, EventCount] = {}  # by run: its rollouts in the ROLLOUTS stream
        self._tenants: dict[str, TenantPlaces] = {}  # each tenant's rollout places in this process
        self.tasks = RunTasks(bus, config, self.handle, self.screen)  # the screen and each run's task consumer
        # This process among the replicas that share each run's admission bound (SharedIssued).
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"

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

    async def close(self) -> None:
        await self.pool.close()
        if self._asgi_client is not None:
            await self._asgi_client.aclose()
        for starting in self._starting.values():
            starting.cancel()
        for loading in self._loading.values():
            loading.cancel()
        await asyncio.gather(*(hosted.policy.close() for hosted in [*self._runs.values(), *self._snapshots.values()]))
        for hosted in self._runs.values():
            if hosted.admission.shared is not None:
                await hosted.admission.shared.close()
        for base in self._bases.values():
            await base.batcher.close()
            await compute(base.backend.close)

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
        if run in self._runs:
            return self._runs[run]
        return await _once(self._starting, run, lambda: self._start(run))

    async def _start(self, run: str) -> HostedRun:
        cfg = await self.run_config(run)
        num_issued = await self._num_rollouts_published(run)
        shared = SharedIssued(self.bus, run, self.replica, self._num_rollouts_published)
        await self._confirm_lapse(run)
        state = self._states.get(run) or await get_run(self.bus, run)
        tenant = state.tenant if state is not None else events.RunState(id=run).tenant
        if tenant not in self._tenants:
            self._tenants[tenant] = TenantPlaces(tenant, self.config.tenant_max_rollouts_in_flight)
        admission = Admission.for_run(cfg, num_issued=num_issued, on_change=self._refresh_info, shared=shared,
                                      tenant=self._tenants[tenant])
        admission.num_skipped = self._num_skipped.pop(run, 0)
        end = self._end(run) if run in self._states else end_of(state) if state is not None else None
        admission.ended = end.reason if end is not None else None

        async def loaded(update: events.WeightUpdate) -> None:
            await admission.loaded(update)
            if run in self._runs:
                self._runs[run].stop_stale()
            self._refresh_info()  # the policy version, even when the admission bound stays

        policy = await self._policy(run, cfg, on_loaded=loaded, on_error=lambda _: self._refresh_info())
        hosted = HostedRun(cfg, policy, admission)
        self._runs[run] = hosted
        if state is not None and state.kind == "eval":
            # An eval's model: no trainer publishes its weights; it is served as its folder holds it.
            policy.serve_as_built()
            self._refresh_info()
            return hosted
        self._refresh_info()
        seen = self._updates.pop(run, {})
        for update in sorted(seen.values() or await weights.updates(self.bus, run, MAX_OFFERED),
                             key=lambda u: u.version):
            policy.offer(update)
        return hosted

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
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return self._snapshots[key]
        return await _once(self._loading, key, lambda: self._load_snapshot(run, step))

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
        policy = await self._policy(f"{run}@{step}", cfg)
        try:
            await policy.load(update)
        except BaseException:
            await policy.close()
            raise
        snapshot = HostedRun(cfg, policy, Admission.for_run(cfg, num_issued=0))
        self._snapshots[run, step] = snapshot
        while len(self._snapshots) > self.config.snapshots_kept:
            _, dropped = self._snapshots.popitem(last=False)
            await self._close_policy(dropped.policy)
        return snapshot

    async def _policy(self, name: str, cfg: RunConfig, on_loaded: OnLoaded | None = None,
                      on_error: Callable[[str], None] | None = None) -> Policy:
        """The policy of run (or snapshot) ``name``. A run that trains an adapter gets a view on
        the shared base of its model (loaded once for every such run, and batched together);
        any other run, or one whose backend keeps no adapters, a backend of its own."""
        if cfg.trainer.adapter is not None:
            key = (cfg.model.name, cfg.model.dtype, cfg.inference.backend.model_dump_json())
            base: SharedBase | Backend
            if key in self._bases:
                base = self._bases[key]
            else:
                base = await _once(self._base_loading, key, lambda: self._load_base(key, cfg))
            if isinstance(base, SharedBase):
                # imported here: torch, loaded only once a LoRA run is hosted
                from flywheel_inference.adapters import AdapterView

                base.names.add(name)
                base.batcher.max_batch_size = max(base.batcher.max_batch_size, cfg.inference.max_batch_size)
                log.info("run %s: adapter on the shared base %s (with %s)", name, cfg.model.name,
                         ", ".join(sorted(base.names - {name})) or "no other run yet")
                self._refresh_info()
                return Policy(name, AdapterView(cast(Any, base.backend), name), self._fetch,
                              cfg.inference.max_batch_size, on_loaded=on_loaded, on_error=on_error,
                              batcher=base.batcher, adapter=name)
            backend = base
        else:
            log.info("run %s: loading model %s (%s backend)", name, cfg.model.name, cfg.inference.backend)
            backend = await compute(self._build, cfg)
            freeze_heap()  # the model and what loading it imported
        return Policy(name, backend, self._fetch, cfg.inference.max_batch_size, on_loaded=on_loaded,
                      on_error=on_error)

    async def _load_base(self, key: tuple[str, str, str], cfg: RunConfig) -> SharedBase | Backend:
        """The shared base of ``key``, loaded now; a backend that keeps no adapters side by side
        (a backend of the user's own) is returned as it is, for the run alone (it merges them)."""
        log.info("loading model %s (%s backend) as a shared base for LoRA runs", cfg.model.name,
                 cfg.inference.backend)
        backend = await compute(self._build, cfg)
        freeze_heap()  # the model and what loading it imported
        if not hasattr(backend, "adapters"):
            return backend
        base = self._bases[key] = SharedBase(cfg.model.name, backend, Batcher(backend, cfg.inference.max_batch_size))
        return base

    async def _close_policy(self, policy: Policy) -> None:
        """Close ``policy``; a shared base whose last adapter it held is closed too."""
        await policy.close()
        for key, base in list(self._bases.items()):
            if getattr(policy.backend, "base", None) is not base.backend:
                continue
            base.names.discard(policy.run)
            if not base.names:
                log.info("shared base %s: no adapter left on it; unloaded", base.model)
                del self._bases[key]
                await base.batcher.close()
                await compute(base.backend.close)
        self._refresh_info()

    async def _num_rollouts_published(self, run: str) -> int:
        """The run's rollouts in the ROLLOUTS stream (a group's batch counts its rollouts)."""
        if run not in self._rollouts_on_bus:
            self._rollouts_on_bus[run] = EventCount(self.bus, "ROLLOUTS", f"rollouts.{run}.>")
        return await self._rollouts_on_bus[run].now()

    async def _fetch(self, update: events.WeightUpdate) -> bytes:
        try:
            return await weights.get(self.bus, update)
        except Exception as exc:
            if _fetch_is_transient(exc):
                raise TransientFetchError(f"{type(exc).__name__}: {exc}") from exc
            raise

    async def environment(self, run: str, env: str, config: RunConfig) -> WorkerEnvironment:
        """The run's environment ``env`` (a task's), loaded once as every service loads it (its
        config's id, args, rewards), in workers of the run's tenant."""
        key = (run, env)
        if key in self._environments:
            return self._environments[key]

        async def load() -> WorkerEnvironment:
            state = self._states.get(run) or await get_run(self.bus, run)
            tenant = state.tenant if state is not None else ""
            found = self._environments[key] = await load_for_run(self.pool, config, env, tenant)
            return found

        return await _once(self._environments_loading, key, load)

    def _refresh_info(self) -> None:
        """Keep the heartbeat's counters current. Called on every change of a run's counters (a
        rollout makes three), it writes them once per turn of the event loop, however many
        changes the turn made: writing them is not free, and nothing reads them within a turn."""
        if not self._info_due:
            self._info_due = True
            asyncio.get_running_loop().call_soon(self._write_info)

    def _write_info(self) -> None:
        self._info_due = False
        runs: dict[str, Any] = {run: {"num_skipped": n} for run, n in self._num_skipped.items()}
        self.info["runs"] = runs | {run: hosted.counters() for run, hosted in self._runs.items()}
        for run, hosted in self._runs.items():
            admission = hosted.admission
            for counter, value in (("issued", admission.num_issued), ("in_flight", admission.num_in_flight),
                                   ("waiting", admission.num_waiting), ("max_issued", admission.max_issued)):
                metrics.ADMISSION.labels(run, counter).set(value)
        self.info["shared_bases"] = [base.counters() for base in self._bases.values()]

    # --- weights ------------------------------------------------------------------------------

    async def on_weight_update(self, update: events.WeightUpdate) -> None:
        if update.run in self._runs:
            self._runs[update.run].policy.offer(update)
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

    def service(self, handle_signals: bool = True) -> Service:
        """The process's Service: the TASKS consumers (the screen, each run's), the weights and
        run-state watchers, the lease check."""
        service = Service("inference", self.bus, info=self.info, handle_signals=handle_signals)
        service.add(self.tasks.screen())
        service.add_task(self.tasks.run)
        service.add_task(self.watch_weights)
        service.add_task(self.watch_runs)
        service.add_task(self.watch_leases)
        return service

    # --- run state ---------------------------------------------------------------------------

    async def watch_runs(self, stopping: asyncio.Event) -> None:
        """Keep every run's current state, and release the waiting tasks of runs that end, until
        ``stopping``. Entries that do not decode are skipped (:func:`flywheel.contract.runs.watch_runs`)."""

        async def on_state(state: events.RunState) -> None:
            self._states[state.id] = state
            self._follow(state.id)
            await self._check_end(state.id)

        await watch_runs(self.bus, stopping, on_state)

    async def watch_leases(self, stopping: asyncio.Event) -> None:
        """Every LEASE_CHECK_S, end the hosted runs whose owner's lease expired: a dead owner
        writes nothing, so no state change announces it."""
        while not stopping.is_set():
            for run in {*self.tasks.runs(), *self._runs}:
                await self._confirm_lapse(run)
            for run in self.tasks.runs():
                self._follow(run)
            for run in list(self._runs):
                await self._check_end(run)
            await wait_at_most(stopping.wait(), LEASE_CHECK_S)

    def _end(self, run: str) -> RunEnd | None:
        """How the run ended by its kept state (None: it goes on). An expired lease counts only once
        a fresh read of the bucket confirmed it (:meth:`_confirm_lapse`): after this process was
        paused (SIGSTOP, a VM pause, a long GC, a cut link) the kept state and the clock say every
        lease lapsed while the owners went on renewing them, and the watcher has not caught up."""
        state = self._states.get(run)
        end = end_of(state) if state is not None else None
        if state is not None and end is not None and end.status == "abandoned" \
                and self._lapse_confirmed.get(run) != state.updated_at:
            return None
        return end

    async def _confirm_lapse(self, run: str) -> None:
        """Re-read the run's state from the bucket when its kept one says its lease lapsed and no
        read confirmed that yet; the fresh state is kept (a renewed lease: the run goes on)."""
        state = self._states.get(run)
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
            self._states[run] = state = fresh
        if end_of(state) is not None:
            self._lapse_confirmed[run] = state.updated_at

    def _follow(self, run: str) -> None:
        """Consume the run's tasks here while it goes on; once it ended, until its durable is empty."""
        state = self._states.get(run)
        if state is None or not state.config:
            return
        end = self._end(run)
        if end is None:
            self.tasks.serve(run)
        else:
            self.tasks.end(run, finished=state.status == "finished")

    async def _check_end(self, run: str) -> None:
        hosted, state = self._runs.get(run), self._states.get(run)
        if hosted is None or state is None:
            return
        end = self._end(run)
        reason = end.reason if end is not None else None
        if reason != hosted.admission.ended:
            log.info("run %s: %s", run, f"{reason}; its waiting tasks are released" if reason else "takes tasks again")
        await hosted.admission.set_ended(reason)
        idle_s = time.monotonic() - hosted.policy.last_used
        if reason is not None and state.kind == "eval" and not hosted.live and idle_s >= EVICT_IDLE_S:
            # An ended eval's model (``flywheel eval --model NAME``) is unloaded; asked for again, it loads again.
            del self._runs[run]
            log.info("run %s: the eval has ended; its model is unloaded", run)
            await self._close_policy(hosted.policy)
            return
        if reason is not None and hosted.policy.adapter is not None and not hosted.live and idle_s >= EVICT_IDLE_S:
            # An ended LoRA run gives its place on the shared base back; it is hosted again
            # (its last adapter loaded) if it is resumed or asked for on the API.
            del self._runs[run]
            log.info("run %s: its adapter is evicted from the shared base", run)
            await self._close_policy(hosted.policy)

    async def _run_state(self, run: str, fresh: bool = False) -> events.RunState:
        """The run's current state (the watcher's; read from the bucket when ``fresh`` or when
        the watcher has none with a config yet); Reject when the run cannot take tasks, and
        never will."""
        state = self._states.get(run)
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

    async def _run_end(self, task: events.Task) -> RunEnd | None:
        """How the task's run ended (None: it goes on); Reject when it cannot take tasks, and never will."""
        end = end_of(await self._run_state(task.run))
        if end is not None:  # confirmed by a fresh read: the watcher may not have seen a resume yet
            state = await self._run_state(task.run, fresh=True)
            cached = self._states.get(task.run)
            if cached is None or cached.updated_at <= state.updated_at:
                self._states[task.run] = state
                if end_of(state) is not None:
                    self._lapse_confirmed[task.run] = state.updated_at  # read just now
                self._follow(task.run)
                await self._check_end(task.run)
            end = end_of(state)
        return end

    async def _handle(self, task: events.Task) -> None:
        from flywheel.sdk import models

        end = await self._run_end(task)
        if end is not None:
            if _published_after(task, end):
                log.info("task %s: published after its run ended (%s); the screen dead-letters it", task.id,
                         end.reason)
            else:  # left over from the task supply
                self._skip(task, end.reason)
            return
        try:
            hosted = await self.hosted(task.run)
        except (UnknownRun, ValueError) as exc:  # deleted meanwhile, or a config that does not parse
            raise Reject(str(exc)) from exc
        try:
            env = await self.environment(task.run, task.env, hosted.config)
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
                slot.num_stored = await self._roll_out(task, env, sampling, hosted, messages)
        except RunEnded as exc:
            # Waiting when the run ended: done with, not an error (counted as num_skipped).
            log.info("task %s: not sampled: %s", task.id, exc)
            return
        record = self._published.setdefault(task.run, OrderedDict())
        record[task.id] = None
        if len(record) > MAX_RECORDED_TASKS:
            record.popitem(last=False)

    def _skip(self, task: events.Task, reason: str) -> None:
        log.info("task %s: not sampled (published before the run ended): %s", task.id, reason)
        if task.run in self._runs:
            self._runs[task.run].admission.skip(task.num_rollouts)
        else:
            self._num_skipped[task.run] = self._num_skipped.get(task.run, 0) + task.num_rollouts
            self._refresh_info()

    async def _roll_out(self, task: events.Task, env: WorkerEnvironment, sampling: events.Sampling,
                        hosted: HostedRun, messages: list[events.Message]) -> int:
        """Run the environment's harness once per rollout of the group, each against its own
        interception URL, and publish the group's rollouts together once all have ended;
        returns how many of them the bus stored (the others it had already). ``messages``: the
        task's first messages, from the environment's worker."""
        async def placed(index: int) -> events.Rollout:
            async with hosted.admission.rollout():  # one of the run's places while it runs
                return await self._one_rollout(task, index, env, sampling, hosted, messages)

        rollouts = [asyncio.ensure_future(placed(i)) for i in range(task.num_rollouts)]
        try:
            results = await asyncio.gather(*rollouts)
        except BaseException:  # the run ended while one waited for a place, or a bug: the group is off
            for rollout in rollouts:
                rollout.cancel()
            await asyncio.gather(*rollouts, return_exceptions=True)
            raise
        try:
            acks = await self.bus.publish_many(results, events.MSGPACK, together=True)  # the group: one message
        except nats.errors.MaxPayloadError:
            # A rollout the bus cannot take (the server drops a connection that sends one): it goes
            # as an error saying so, without its graph, so its group is done and the run goes on.
            results = [self._fitted(r) for r in results]
            acks = await self.bus.publish_many(results, events.MSGPACK, together=True)
        for done in results:
            metrics.ROLLOUTS.labels(done.run, done.status).inc()
            if done.usage is not None:
                metrics.TOKENS.labels(done.run).inc(done.usage.sampled_tokens)
        return await self._num_stored(results, acks)

    def _fitted(self, rollout: events.Rollout) -> events.Rollout:
        """``rollout``, or when the bus cannot take it (over nats-server's max_payload), the same
        rollout failed with the reason and without its trace graph, state and task row."""
        size, most = self.bus.published_size(rollout, events.MSGPACK), self.bus.nc.max_payload
        if size <= most:
            return rollout
        log.warning("rollout %s of task %s: %d bytes, more than the bus takes (%d); published as an error",
                    rollout.id, rollout.task_id, size, most)
        return msgspec.structs.replace(
            rollout, status="error", nodes=[], state={}, task_data={},
            error=f"rollout {rollout.id}: its trace graph and state are {size} bytes, more than the bus takes "
                  f"({most} bytes, nats-server's max_payload); lower sampling.max_tokens or the harness's turns, "
                  "or raise max_payload")

    async def _num_stored(self, rollouts: Sequence[events.Rollout], acks: Sequence[PubAck]) -> int:
        """How many of ``rollouts`` this publish stored (a batch's share its ack). A duplicate's
        ack names the stored copy: the same bytes are this publish's own (its ack was lost and it
        was sent again); other bytes were sampled by an earlier delivery of the task (another
        process, or before a restart)."""
        num_stored = 0
        by_message: dict[int, tuple[PubAck, list[events.Rollout]]] = {}
        for rollout, ack in zip(rollouts, acks, strict=True):
            by_message.setdefault(ack.seq, (ack, []))[1].append(rollout)
        for ack, members in by_message.values():
            if not ack.duplicate:
                num_stored += len(members)
                continue
            try:
                stored = await self.bus.js.get_msg(ack.stream, ack.seq)
            except nats.js.errors.NotFoundError:  # gone already (the stream's limits): not this one's
                continue
            ours = (events.encode_many(members, events.MSGPACK) if len(members) > 1
                    else events.encode(members[0], events.MSGPACK))
            if stored.data == ours:
                num_stored += len(members)
        if num_stored < len(rollouts):
            log.info("task %s: %d of its %d rollouts were on the bus already (an earlier delivery); not counted",
                     rollouts[0].task_id, len(rollouts) - num_stored, len(rollouts))
        return num_stored

    async def _one_rollout(self, task: events.Task, index: int, env: WorkerEnvironment, sampling: events.Sampling,
                           hosted: HostedRun, messages: list[events.Message]) -> events.Rollout:
        """One rollout of the group, its harness run in a worker of the environment (a plain chat
        harness here, from the task's first ``messages``; by the rules of :mod:`flywheel.sdk.rollout`),
        against its own interception session, whose trace nodes go out before the rollout."""
        rid = events.rollout_id(task.run, task.id, index)
        sampling = sampling.with_seed_offset(index)

        async def publish(nodes: list[events.TraceNode]) -> None:
            if nodes:
                await self.bus.publish_many(nodes, events.MSGPACK, together=True)  # a call's: one message

        session = self.interception.open(task.run, rid, hosted.policy, sampling, publish,
                                         live_after_s=self.config.live_trace_after_s)
        base_url, http_client, post = self._interception_url(session.key)
        link = RolloutLink(rid, task.run, base_url=base_url, api_key=session.key, post=post, http_client=http_client,
                           sandbox=self.pool.sandbox)
        stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        hosted.live[rid] = (session, stop)
        try:
            try:
                running = await env.start_rollout(link, messages)
            except WorkerError as exc:  # no worker for it: this rollout fails, saying why
                ran = Ran(f"environment worker failed: {exc}", {}, False, 0.0)
            else:
                if running.hooks:
                    session.hooks = running.hooks
                stop.add_done_callback(lambda done: running.stop(done.result()))
                ran = await running.run(task.data, model=task.run, index=index, timeout_s=self.config.rollout_timeout_s)
        finally:
            del hosted.live[rid]
            self.interception.close(session.key)
        outcome = conclude(ran, session, rid, index)
        await session.flush()  # its trace nodes before the rollout
        hooks = session.hooks.metrics() if session.hooks else {}
        return events.Rollout(
            id=rid, run=task.run, env=task.env, task_id=task.id, group_id=task.id, index=index,
            policy_version=min(session.versions, default=hosted.policy.version or 0), task_data=task.data,
            nodes=session.graph.ordered(), status=outcome.status, error=outcome.error,
            metrics=session.metrics() | hooks | {"rollout_s": outcome.elapsed_s},
            group_size=task.num_rollouts,
            state=outcome.state, sampling=sampling, usage=session.usage())

    def _interception_url(self, key: str) -> tuple[str, Any, Any]:
        """(base URL, http client, in-process post) of a rollout. The URL is this server's when it
        has one (a program harness needs a real one); in-process harnesses share one client that
        reaches the interception routes in process (no socket:
        :class:`~flywheel_inference.interception.InProcessTransport`), whatever host the URL
        names, and the transport's ``post`` for :meth:`~flywheel.sdk.harness.RolloutContext.chat`."""
        if self._asgi_client is None:
            # Imported here, not at the top: building a worker (tests, tools) needs no web stack.
            import httpx
            from fastapi import FastAPI

            from flywheel_inference import agent_apis, interception

            app = FastAPI()
            interception.install(app)
            agent_apis.install(app)
            app.state.interception = self.interception
            self._in_process = interception.InProcessTransport(app, self.interception)
            self._asgi_client = httpx.AsyncClient(transport=self._in_process, timeout=None)
        url = self.url or "http://inference"
        return f"{url}/intercept/{key}/v1", self._asgi_client, self._in_process.post
