"""Environments served in this process, for unit tests: the worker's own code over a channel in memory.

Services run environments in sandboxed worker processes (:class:`flywheel.runtime.environments.WorkerPool`).
Unit tests start no processes and build environments inline, with functions of their own, so
:class:`InProcessPool` is a pool whose workers are :class:`flywheel.runtime.envworker.Worker`
objects in this process, each talking to the pool over a channel in memory: the same host code
and the same worker code, without the process and its sandbox. What crosses the process
boundary (the sandbox, a worker that dies) is tested against real workers in
``tests/integration/test_envworkers.py``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from flywheel.contract import events
from flywheel.contract.settings import WorkersSettings
from flywheel.runtime.channel import Channel
from flywheel.runtime.environments import WorkerEnvironment, WorkerPool, WorkerProcess
from flywheel.runtime.envworker import LoadSpec, Worker, _Loaded, environment_info
from flywheel.sdk.environment import Environment, GroupReward, Reward
from flywheel.sdk.hooks import CallHooks
from flywheel.sdk.sandbox import SandboxClient

_pids = itertools.count(900_001)


class AdoptingWorker(Worker):
    """A worker that loads the environments it was given by name (their functions are the
    test's own), and any other by id as a worker does."""

    def __init__(self, envs: Mapping[str, Environment | Callable[[], Environment]]) -> None:
        super().__init__()
        self.envs = envs

    async def load(self, args: Any) -> dict[str, Any]:
        spec = msgspec.convert(args, LoadSpec)
        given = self.envs.get(spec.env_id)
        if given is None:
            return await super().load(args)
        env = (given if isinstance(given, Environment) else given()).with_overrides(spec.overrides())
        rewards = {r.name: r for r in env.rewards if isinstance(r, Reward | GroupReward)}
        handle = next(self._handles)
        self.loaded[handle] = _Loaded(env, rewards, environment_info(env))
        return {"handle": handle, "info": msgspec.to_builtins(self.loaded[handle].info)}


class MemoryProcess:
    """A worker "process": an :class:`AdoptingWorker` served on one end of a channel in memory."""

    def __init__(self, envs: Mapping[str, Environment | Callable[[], Environment]]) -> None:
        self.pid = next(_pids)
        self.to_worker, self.to_host = asyncio.StreamReader(), asyncio.StreamReader()
        self.worker = AdoptingWorker(envs)

        async def write(data: bytes) -> None:
            self.to_host.feed_data(data)

        self.worker.channel = Channel(self.to_worker.readexactly, write, self.worker.handlers())
        self.serving = asyncio.ensure_future(self.worker.channel.serve())

    @property
    def returncode(self) -> int | None:
        return 0 if self.serving.done() else None

    async def wait(self) -> int:
        await asyncio.gather(self.serving, return_exceptions=True)
        return 0

    def last_words(self) -> str:
        return ""

    async def stop(self) -> None:
        self.to_worker.feed_eof()
        await self.wait()
        self.to_host.feed_eof()


class InProcessPool(WorkerPool):
    """A :class:`WorkerPool` whose workers are :class:`MemoryProcess` objects (see the module)."""

    def __init__(self, envs: Mapping[str, Environment | Callable[[], Environment]] | None = None,
                 settings: WorkersSettings | None = None, sandbox: SandboxClient | None = None) -> None:
        super().__init__(settings or WorkersSettings(), Path("/nonexistent/flywheel-data"), name="test",
                         sandbox=sandbox)
        self.envs = dict(envs or {})

    async def start_worker(self, key: tuple[str, ...], label: str) -> WorkerProcess:
        process = MemoryProcess(self.envs)

        async def write(data: bytes) -> None:
            process.to_worker.feed_data(data)

        return WorkerProcess(self, key, label, process, process.to_host.readexactly, write)


async def served(env: Environment, pool: InProcessPool | None = None, tenant: str = "") -> WorkerEnvironment:
    """``env`` loaded in ``pool`` (a pool of its own when None) under its name."""
    pool = pool or InProcessPool()
    pool.envs[env.name] = env
    return await pool.load(LoadSpec(env_id=env.name), tenant)


async def evaluated(cfg: Any, env: Environment, progress: Any, nats_url: str | None = None) -> dict[str, Any]:
    """``flywheel eval``'s :class:`~flywheel.runtime.evaluation.Evaluation` of ``env`` (served in a pool of
    its own, closed after) with ``cfg``; its summary."""
    from flywheel.runtime.evaluation import Evaluation

    pool = InProcessPool()
    try:
        return await Evaluation(cfg, await served(env, pool), progress).run(nats_url)
    finally:
        await pool.close()


class AsyncHooks:
    """In-process hooks (:class:`flywheel.sdk.hooks.CallHooks`) asked as a worker's are
    (:class:`flywheel.runtime.environments.Hooks`), for unit tests of what asks them."""

    def __init__(self, hooks: CallHooks) -> None:
        self.hooks = hooks

    @property
    def flags(self) -> dict[str, int]:
        return self.hooks.flags

    def __bool__(self) -> bool:
        return bool(self.hooks)

    async def before(self, messages: list[events.Message]) -> list[events.Message]:
        return self.hooks.before(messages)

    async def after(self, messages: list[events.Message], answer: events.Message) -> None:
        self.hooks.after(messages, answer)

    def metrics(self) -> dict[str, float]:
        return self.hooks.metrics()
