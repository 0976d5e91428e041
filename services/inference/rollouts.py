"""A task's group rolled out: its environment's harness run once per rollout, each against its
own interception session, and the group published when every harness has ended.

The run's environment is loaded as every service loads it
(:func:`flywheel.runtime.runs.load_for_run`: its config's id, args, rewards), once per run and
environment, in workers of the run's tenant. Each rollout runs its harness in a worker of the
environment against its own interception URL (:mod:`flywheel_inference.interception`), which
samples from the run's policy and publishes trace nodes as the calls complete (once the rollout
has run ``live_trace_after_s``; a shorter one's travel in its rollout only); the group's
rollouts go out together (:mod:`flywheel_inference.publishing`).

A harness that raises, runs past ``rollout_timeout_s`` or never calls the model gives a rollout
with status ``error`` and the reason (scored, never trained on); the service goes on:
:mod:`flywheel.sdk.rollout` holds these rules, the same in ``flywheel eval``. A rollout that goes
stale while it runs (weights are loaded that leave one of its model calls more than
``max_off_policy_steps`` behind, typically while a slow environment holds it) is stopped at
once and published as an ``error`` saying so: the trainer would drop it anyway, and counts it
as stale; stopping it gives its place and its budget back now
(:meth:`flywheel_inference.hosting.HostedRun.stop_stale`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from flywheel.contract import events
from flywheel.contract.bus import Bus
from flywheel.contract.config import RunConfig
from flywheel.contract.runs import get_run
from flywheel.contract.settings import InferenceSettings
from flywheel.runtime.environments import RolloutLink, WorkerEnvironment, WorkerError, WorkerPool
from flywheel.runtime.runs import load_for_run
from flywheel.sdk.rollout import Ran, conclude
from flywheel_inference.hosting import HostedRun
from flywheel_inference.interception import Interception
from flywheel_inference.once import once
from flywheel_inference.publishing import publish_group
from flywheel_inference.run_states import RunStates


@dataclass
class Rollouts:
    """Rolls out groups: the runs' environments in workers of ``pool``, the harnesses against
    sessions of ``interception``. ``url``: where this process's HTTP server is reached (None:
    none); the programs of program harnesses reach their rollout's endpoint there through their
    sandbox's model relay."""

    bus: Bus
    config: InferenceSettings
    pool: WorkerPool
    interception: Interception
    states: RunStates  # the runs' tenants, whose workers their environments run in
    url: str | None = None
    _environments: dict[tuple[str, str], WorkerEnvironment] = field(default_factory=dict)
    _environments_loading: dict[tuple[str, str], asyncio.Future[WorkerEnvironment]] = field(default_factory=dict)
    _asgi_client: Any = None
    _in_process: Any = None  # the in-process transport behind _asgi_client

    async def close(self) -> None:
        if self._asgi_client is not None:
            await self._asgi_client.aclose()

    async def environment(self, run: str, env: str, config: RunConfig) -> WorkerEnvironment:
        """The run's environment ``env`` (a task's), loaded once as every service loads it (its
        config's id, args, rewards), in workers of the run's tenant."""
        key = (run, env)
        if key in self._environments:
            return self._environments[key]

        async def load() -> WorkerEnvironment:
            state = self.states.get(run) or await get_run(self.bus, run)
            tenant = state.tenant if state is not None else ""
            found = self._environments[key] = await load_for_run(self.pool, config, env, tenant)
            return found

        return await once(self._environments_loading, key, load)

    async def roll_out(self, task: events.Task, env: WorkerEnvironment, sampling: events.Sampling,
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
        return await publish_group(self.bus, results)

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
