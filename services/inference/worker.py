"""The inference worker: tasks in, trace nodes and rollouts out, weight updates applied.

- Tasks come from one durable pull consumer on TASKS (``inference``), shared by every
  replica. A task is rolled out ``num_rollouts`` times as one group: the run's environment
  (loaded as every service loads it, :func:`flywheel.environment.load_for_run`) runs its
  harness once per rollout, each against its own interception URL
  (:mod:`flywheel_inference.interception`), which samples from the run's policy and
  publishes trace nodes as the calls complete; the group's rollouts go out together when
  every harness has ended.
- Each run named by a task gets a :class:`HostedRun` on first sight: its config (from the
  runs KV bucket), its policy (the run's model, loaded once) and its admission counters.
  No rollout is sampled before the run's first weight update (version 0, published by
  the trainer after any warm-up) is loaded, so inference and trainer start from the same
  weights.
- Weight updates come from an ordered consumer on WEIGHTS that starts at the last update
  of every run, so each replica sees every update and a late one catches up. The run's
  policy loads the newest update it has seen; once loaded, the update advances the
  run's admission bound, so the rollouts it lets in are sampled by the new weights.

A task waiting for its run's admission holds one of the consumer's ``max_tasks_in_flight``
slots, so a run far ahead of its trainer can delay other runs' tasks (the bound is per
process, not per run). A run's config is read once, when the run is first seen.

Failures: a task that can never succeed (an environment that does not load, a row that
does not match the task set's schema, bad sampling settings, a group larger than the
admission bounds) is dead-lettered at once with the reason; a run without a config yet, or
whose weights failed to load, fails the delivery, which the bus retries with backoff before
dead-lettering it. A harness that raises, runs past ``rollout_timeout_s`` or never calls the
model gives a rollout with status ``error`` and the reason (scored, never trained on); the
service goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from nats.js.api import DeliverPolicy

from flywheel import events
from flywheel.bus import HEADER_CONTENT_TYPE, Bus, Consumer, Delivery, Reject
from flywheel.config import RunConfig
from flywheel.environment import Environment, EnvironmentLoadError, load_for_run
from flywheel.runs import get_run, watch_runs
from flywheel.service import Service
from flywheel_inference.admission import Admission, RunEnded
from flywheel_inference.backends import Backend, build_backend
from flywheel_inference.interception import Interception
from flywheel_inference.policy import Policy

log = logging.getLogger(__name__)

DURABLE = "inference"


def rollout_id(task_id: str, index: int) -> str:
    """Rollout ids hash (task id, index): a redelivered task publishes the same ids, which the bus
    deduplicates."""
    return hashlib.sha256(f"{task_id}\x00{index}".encode()).hexdigest()[:32]


class UnknownRun(LookupError):
    """No run of this id in the runs KV bucket."""


@dataclass
class WorkerConfig:
    """Bounds of the task consumer. Defaults suit one machine."""

    # Tasks handled at once (each holding its group's rollouts in flight or waiting for
    # admission): enough for several groups to share a batch.
    max_tasks_in_flight: int = 32
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = (1.0, 5.0, 15.0, 30.0)
    grace_s: float = 10.0
    # A rollout's harness gets this long before it is cancelled and recorded as an error.
    rollout_timeout_s: float = 600.0


@dataclass
class HostedRun:
    config: RunConfig
    policy: Policy
    admission: Admission

    @property
    def sampling(self) -> events.Sampling:
        s = self.config.sampling
        return events.Sampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, stop=list(s.stop))

    def counters(self) -> dict[str, Any]:
        return {"policy_version": self.policy.version, **self.admission.counters()}


BuildBackend = Callable[[RunConfig], Backend]


class Worker:
    def __init__(self, bus: Bus, build: BuildBackend, config: WorkerConfig | None = None) -> None:
        self.bus = bus
        self.config = config or WorkerConfig()
        self.info: dict[str, Any] = {"runs": {}}  # the heartbeat's info: counters per run
        self._build = build
        self._runs: dict[str, HostedRun] = {}
        self._starting: dict[str, asyncio.Future[HostedRun]] = {}
        self._latest: dict[str, events.WeightUpdate] = {}  # newest update seen per run
        self._ended: set[str] = set()  # runs whose state says finished or failed
        self._environments: dict[str, Environment] = {}
        self.interception = Interception()
        self._asgi_client: Any = None

    @classmethod
    def with_backends(cls, bus: Bus, data_dir: Path, config: WorkerConfig | None = None) -> Worker:
        """A worker that builds each run's backend from its config (model resolved under ``data_dir``)."""

        def build(cfg: RunConfig) -> Backend:
            from flywheel import models

            return build_backend(cfg.inference.backend, models.resolve_model(cfg.model.name, data_dir),
                                 cfg.model.dtype)

        return cls(bus, build, config)

    def consumer(self) -> Consumer:
        c = self.config
        return Consumer(self.bus, stream="TASKS", durable=DURABLE, handler=self.handle, event_type=events.Task,
                        max_in_flight=c.max_tasks_in_flight, ack_wait_s=c.ack_wait_s, max_deliver=c.max_deliver,
                        backoff_s=c.backoff_s, grace_s=c.grace_s)

    async def close(self) -> None:
        if self._asgi_client is not None:
            await self._asgi_client.aclose()
        for starting in self._starting.values():
            starting.cancel()
        await asyncio.gather(*(hosted.policy.close() for hosted in self._runs.values()))

    # --- runs ---------------------------------------------------------------------------------

    async def run_config(self, run: str) -> RunConfig:
        state = await get_run(self.bus, run)
        if state is None:
            raise UnknownRun(f"run {run!r} is not in the runs bucket")
        if not state.config:
            raise ValueError(f"run {run!r} has no config yet (RunState.config is empty); `flywheel run` writes it")
        return RunConfig.parse(state.config, source=f"run {run!r} config")

    async def hosted(self, run: str) -> HostedRun:
        """The run's config, policy and admission counters, built on first use (once)."""
        if run in self._runs:
            return self._runs[run]
        if run not in self._starting:
            self._starting[run] = asyncio.ensure_future(self._start(run))
        starting = self._starting[run]
        try:
            return await asyncio.shield(starting)
        finally:
            if starting.done():
                self._starting.pop(run, None)

    async def _start(self, run: str) -> HostedRun:
        cfg = await self.run_config(run)
        num_issued = await self._num_rollouts_published(run)
        log.info("run %s: loading model %s (%s backend)", run, cfg.model.name, cfg.inference.backend)
        backend = await asyncio.to_thread(self._build, cfg)
        admission = Admission.for_run(cfg, num_issued=num_issued, on_change=self._refresh_info)
        admission.ended = run in self._ended

        async def loaded(update: events.WeightUpdate) -> None:
            await admission.advance(update.version, int(update.metrics.get("num_dropped_total", 0)))
            self._refresh_info()  # the policy version, even when the admission bound stays

        policy = Policy(run, backend, self._fetch, cfg.inference.max_batch_size, on_loaded=loaded)
        hosted = HostedRun(cfg, policy, admission)
        self._runs[run] = hosted
        if run in self._latest:
            policy.offer(self._latest[run])
        self._refresh_info()
        return hosted

    async def _num_rollouts_published(self, run: str) -> int:
        info = await self.bus.js.stream_info("ROLLOUTS", subjects_filter=f"rollouts.{run}.>")
        return sum((info.state.subjects or {}).values())

    async def _fetch(self, update: events.WeightUpdate) -> bytes:
        from flywheel import weights

        return await weights.get(self.bus, update)

    def environment(self, run: str, config: RunConfig) -> Environment:
        """The run's environment, loaded once as every service loads it (its config's env, args, rewards)."""
        if run not in self._environments:
            self._environments[run] = load_for_run(config)
        return self._environments[run]

    def _refresh_info(self) -> None:
        """Keep the heartbeat's counters current (called on every change of a run's counters)."""
        self.info["runs"] = {run: hosted.counters() for run, hosted in self._runs.items()}

    # --- weights ------------------------------------------------------------------------------

    async def on_weight_update(self, update: events.WeightUpdate) -> None:
        latest = self._latest.get(update.run)
        if latest is not None and latest.version >= update.version:
            return
        self._latest[update.run] = update
        if update.run in self._runs:
            self._runs[update.run].policy.offer(update)

    async def watch_weights(self, stopping: asyncio.Event) -> None:
        """Every weight update of every run, from the last one per run on, until ``stopping``."""
        sub = await self.bus.js.subscribe("weights.>", ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        decoder = events.Decoder(events.WeightUpdate)
        try:
            while not stopping.is_set():
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except nats.errors.TimeoutError:
                    continue
                update = decoder.decode(msg.data, (msg.headers or {}).get(HEADER_CONTENT_TYPE))
                await self.on_weight_update(update)
        finally:
            await sub.unsubscribe()

    def service(self, handle_signals: bool = True) -> Service:
        """The process's Service: the TASKS consumer, the weights and run-state watchers."""
        service = Service("inference", self.bus, info=self.info, handle_signals=handle_signals)
        service.add(self.consumer())
        service.add_task(self.watch_weights)
        service.add_task(self.watch_runs)
        return service

    # --- run state ---------------------------------------------------------------------------

    async def watch_runs(self, stopping: asyncio.Event) -> None:
        """End admission for runs whose state becomes finished or failed, until ``stopping``."""

        async def on_state(state: events.RunState) -> None:
            if state.status in ("finished", "failed"):
                self._ended.add(state.id)
                if state.id in self._runs:
                    await self._runs[state.id].admission.end()

        await watch_runs(self.bus, stopping, on_state)

    # --- tasks --------------------------------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        from flywheel import models

        task: events.Task = delivery.event
        if task.run in self._ended:
            log.info("task %s: run %s has ended; not sampled", task.id, task.run)
            return
        hosted = await self.hosted(task.run)
        try:
            env = self.environment(task.run, hosted.config)
        except EnvironmentLoadError as exc:
            raise Reject(str(exc)) from exc
        try:
            env.check_task(task.data)
            messages = env.prompt_messages(task.data)
        except EnvironmentLoadError as exc:
            raise Reject(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - the environment's code on this row: the task is bad
            raise Reject(f"environment {task.env!r}: its first messages for this task failed: "
                         f"{type(exc).__name__}: {exc}") from exc
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
            await hosted.policy.wait_ready()
            async with hosted.admission.slot(task.num_rollouts):
                await self._roll_out(task, env, sampling, hosted)
        except RunEnded:
            # Left over when the run ended: done with, not an error (counted as num_skipped).
            log.info("task %s: run %s has ended; not sampled", task.id, task.run)

    async def _roll_out(self, task: events.Task, env: Environment, sampling: events.Sampling,
                        hosted: HostedRun) -> None:
        """Run the environment's harness once per rollout of the group, each against its own
        interception URL, and publish the group's rollouts together once all have ended."""
        results = await asyncio.gather(*(self._one_rollout(task, i, env, sampling, hosted)
                                         for i in range(task.num_rollouts)))
        await self.bus.publish_many(results, events.MSGPACK)

    async def _one_rollout(self, task: events.Task, index: int, env: Environment, sampling: events.Sampling,
                           hosted: HostedRun) -> events.Rollout:
        from flywheel.harness import RolloutContext
        from flywheel.sandbox import SandboxClient

        rid = rollout_id(task.id, index)
        if sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + index)

        async def publish(nodes: list[events.TraceNode]) -> None:
            if nodes:
                await self.bus.publish_many(nodes, events.MSGPACK)

        session = self.interception.open(task.run, rid, hosted.policy, sampling, publish)
        base_url, http_client = self._interception_url(session.key)
        ctx = RolloutContext(task=dict(task.data), base_url=base_url, api_key=session.key, model=task.run,
                             index=index, timeout_s=self.config.rollout_timeout_s, http_client=http_client,
                             rollout_id=rid, sandbox_client=SandboxClient(self.bus))
        error: str | None = None
        started = asyncio.get_running_loop().time()
        try:
            assert env.harness is not None
            await asyncio.wait_for(env.harness.run(env, ctx), self.config.rollout_timeout_s)
        except TimeoutError:
            error = f"the harness ran past rollout_timeout_s={self.config.rollout_timeout_s}"
        except Exception as exc:  # noqa: BLE001 - the environment's code: recorded on this rollout
            error = f"harness failed: {type(exc).__name__}: {exc}"
            log.info("rollout %s of task %s: %s", index, task.id, error)
        finally:
            self.interception.close(session.key)
            await ctx.close()
        await session.flush()  # its trace nodes before the rollout
        if error is None and session.num_calls == 0:
            error = "the harness made no model call"
        status = "error" if error else "truncated" if session.truncated or ctx.state.get("truncated") else "completed"
        metrics = session.metrics() | {"rollout_s": asyncio.get_running_loop().time() - started}
        try:
            state = msgspec.json.decode(msgspec.json.encode(ctx.state))
        except (TypeError, msgspec.EncodeError) as exc:
            state, error, status = {}, f"the harness's state is not JSON: {exc}", "error"
        return events.Rollout(
            id=rid, run=task.run, env=task.env, task_id=task.id, group_id=task.id, index=index,
            policy_version=min(session.versions, default=hosted.policy.version or 0), task_data=task.data,
            nodes=session.graph.ordered(), status=status, error=error, metrics=metrics,
            group_size=task.num_rollouts, state=state)

    def _interception_url(self, key: str) -> tuple[str, Any]:
        """(base URL, http client) of a rollout. The URL is this server's when it has one (a
        program harness needs a real one); in-process harnesses share one client that reaches
        the interception routes in process (ASGI, no socket), whatever host the URL names."""
        if self._asgi_client is None:
            import httpx
            from fastapi import FastAPI

            from flywheel_inference import api

            app = FastAPI()
            api.install(app)
            app.state.worker = self
            self._asgi_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=None)
        url = self.info.get("url") or "http://inference"
        return f"{url}/intercept/{key}/v1", self._asgi_client
