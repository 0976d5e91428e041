"""The environment worker: environments run here, in a sandboxed process, never in a service.

A worker is one process (started by :mod:`flywheel.runtime.environments` in the sandbox of
:mod:`flywheel.runtime.isolation`) that hosts one environment version for one tenant. Its host
(the inference service, the scorer, the orchestrator, the trainer, ``flywheel run`` and
``flywheel eval``) calls it over a :class:`~flywheel.runtime.channel.Channel` on the worker's
stdin and stdout; nothing else reaches it, and it reaches nothing else: no network, no
credential, no file of the platform's but the packages it runs.

What the host asks (each op's arguments and answer are plain msgpack values):

- ``load``: build an environment (:func:`flywheel.sdk.environment.load_environment`, with a
  run's args and reward overrides), or one custom scorer's function; answers a handle and
  the environment's :class:`EnvironmentInfo`. One worker holds several (a run's own args);
- ``tasks``, ``prompt``, ``privileged``, ``references``: task rows, a task's first messages
  (its row checked against the task set's schema), with a teacher's privileged context, and
  reference answers for supervised steps;
- ``roll_out``: run the harness on one task (:func:`flywheel.sdk.rollout.run_only`); its
  model calls, HTTP requests and sandbox requests go back to the host (``post``, ``http``,
  ``sandbox``, ``program``: the host decides what each may reach, see the host module), and
  so do environment code's calls to the endpoints its run's config names (``egress``, a user
  simulator's model: :mod:`flywheel.sdk.egress`);
  ``stop`` ends a rollout early; ``hook_before`` and ``hook_after`` run the environment's
  hooks on a model call of a rollout under way;
- ``score``, ``score_group``: rewards and group rewards on rollouts, by the scoring core's
  rules (:class:`flywheel.sdk.scoring.Scoring`: timeouts, errors as outcomes);
- ``ping``: the host's check that the worker's event loop still answers.

The worker's own stdout is the channel's: what environment code prints goes to stderr, which
the host keeps the end of (a worker that dies says why there).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flywheel.contract import events
from flywheel.runtime.channel import Channel
from flywheel.sdk import egress
from flywheel.sdk import sandbox as sandbox_sdk
from flywheel.sdk.environment import (
    Environment,
    EnvironmentLoadError,
    EnvironmentOverrides,
    GroupReward,
    Reward,
    RewardOverride,
    Value,
    load_environment,
)
from flywheel.sdk.harness import PROGRAM_RUNNER, ChatHarness, ProgramHarness, RolloutContext
from flywheel.sdk.hooks import Blocked, CallHooks
from flywheel.sdk.rollout import run_only
from flywheel.sdk.sandbox import metered_to
from flywheel.sdk.sandbox_tools import use_client
from flywheel.sdk.scoring import Scoring

log = logging.getLogger(__name__)

# Where a rollout's model is inside a worker: every request to this host goes back to the
# worker's host over the channel (the path after /<rollout>/v1), nowhere else.
MODEL_HOST = "model.flywheel"
NUM_REWARD_THREADS = 8


# --- what crosses the channel -------------------------------------------------------------------


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class RewardInfo(_Struct, frozen=True):
    name: str
    weight: float
    group: bool = False


class EnvironmentInfo(_Struct, frozen=True):
    """What a host knows of an environment it does not run: names, weights, defaults."""

    name: str
    version: str = "0.0.0"
    description: str = ""
    rewards: list[RewardInfo] = []
    sampling: dict[str, Any] = {}
    has_reference: bool = False
    harness: str = "ChatHarness"  # its type's name
    argv: list[str] = []  # a program harness's command line
    runtime: str | None = None  # where a program harness runs
    hooks: bool = False  # whether it has request or response hooks
    # Its harness's turns where it is the platform's ChatHarness with nothing of the environment's
    # in its loop (plain_chat_turns), else None. Its host may run such a rollout itself from the
    # task's first messages (WorkerEnvironment.start_rollout): what the worker would run is
    # platform code only.
    plain_chat_turns: int | None = None

    @property
    def weights(self) -> dict[str, float]:
        """Every reward's weight by name (metrics have 0), as :attr:`Environment.weights`."""
        return {r.name: r.weight for r in self.rewards}

    @property
    def rollout_rewards(self) -> list[str]:
        return [r.name for r in self.rewards if not r.group]

    @property
    def group_rewards(self) -> list[str]:
        return [r.name for r in self.rewards if r.group]


class LoadSpec(_Struct, frozen=True):
    """What to load: an environment by id with a run's overrides, or (``function``) one custom
    scorer's function ``module:name``, named ``name``, of ``weight``, a group reward or not."""

    env_id: str = ""
    args: dict[str, Any] = {}
    rewards: dict[str, dict[str, Any]] = {}  # name -> {"weight", "function", "group"}
    harness: str | None = None
    runtime: str | None = None
    function: str | None = None
    name: str | None = None
    weight: float = 1.0
    group: bool = False

    @classmethod
    def of(cls, env_id: str, overrides: EnvironmentOverrides | None = None) -> LoadSpec:
        if overrides is None:
            return cls(env_id=env_id)
        return cls(env_id=env_id, args=dict(overrides.args), harness=overrides.harness, runtime=overrides.runtime,
                   rewards={name: {k: v for k, v in vars(r).items() if v is not None}
                            for name, r in overrides.rewards.items()})

    @property
    def key(self) -> str:
        """The same text for the same spec (what a host keys loaded handles by)."""
        return json.dumps(msgspec.to_builtins(self), sort_keys=True)

    def overrides(self) -> EnvironmentOverrides:
        return EnvironmentOverrides(args=dict(self.args), harness=self.harness, runtime=self.runtime,
                                    rewards={name: RewardOverride(**r) for name, r in self.rewards.items()})


class RewardOutcome(_Struct, frozen=True):
    """One reward on one rollout: its value and components, or the error."""

    name: str
    value: float | None = None
    components: dict[str, float] = {}
    error: str | None = None
    elapsed_s: float = 0.0


class HookOutcome(_Struct, frozen=True):
    """A request hook's verdict: new messages (None: as they were), or the call blocked (by which hook, why)."""

    messages: list[events.Message] | None = None
    blocked: str | None = None
    blocked_hook: str | None = None


def environment_info(env: Environment) -> EnvironmentInfo:
    harness = env.harness
    rewards = [RewardInfo(name=r.name, weight=r.weight, group=isinstance(r, GroupReward)) for r in env.rewards
               if isinstance(r, Reward | GroupReward)]
    return EnvironmentInfo(name=env.name, version=env.version, description=env.description, rewards=rewards,
                           sampling=dict(env.sampling), has_reference=env.reference is not None,
                           harness=type(harness).__name__,
                           argv=[str(a) for a in getattr(harness, "argv", ())],
                           runtime=getattr(harness, "runtime", None),
                           hooks=bool(env.request_hooks or env.response_hooks),
                           plain_chat_turns=plain_chat_turns(harness))


def plain_chat_turns(harness: Any) -> int | None:
    """``harness``'s turns where it is the platform's own :class:`ChatHarness` (not a subclass) with
    no part of the environment's in its loop (its first messages are all it takes from the
    environment); None otherwise."""
    if (isinstance(harness, ChatHarness) and type(harness) is ChatHarness and not harness.tools
            and harness.env_response is None and harness.user is None and harness.stop is None
            and harness.setup is None):
        return harness.max_turns
    return None


# --- what a rollout reaches, from inside a worker ----------------------------------------------------


class ChannelSandboxClient(sandbox_sdk.SandboxClient):
    """The sandbox client of a rollout (or a scored rollout) inside a worker: every request goes
    to the host, which makes it on the rollout's behalf, to the rollout's own sandboxes only."""

    def __init__(self, channel: Channel, scope: str) -> None:
        super().__init__(bus=None)  # type: ignore[arg-type]  # requests go over the channel, never a bus
        self.channel = channel
        self.scope = scope

    async def _request(self, op: str, message: msgspec.Struct, timeout_s: float, instance: str | None = None) -> Any:
        answer = await self.channel.call("sandbox", {"scope": self.scope, "op": op, "request": sandbox_sdk.encode(
            message), "timeout_s": timeout_s})
        reply = sandbox_sdk._reply_decoders[op].decode(answer)
        if isinstance(reply, sandbox_sdk.ErrorReply):
            raise sandbox_sdk.SandboxError(reply.kind, reply.error)
        return reply

    async def destroy_by_label(self, labels: Mapping[str, str]) -> int:
        return int(await self.channel.call("sandbox", {"scope": self.scope, "op": "destroy_by_label",
                                                       "request": msgspec.json.encode(dict(labels)),
                                                       "timeout_s": self.request_timeout_s}))


def _transport(channel: Channel, op: str, where: Callable[[Any], dict[str, str]]) -> Any:
    """An httpx transport that sends each request to the host as ``op``, ``where(request)`` saying where to."""
    import httpx

    class Transport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = await request.aread()
            answer = await channel.call(op, {**where(request), "method": request.method,
                                             "headers": [[k.decode("latin-1"), v.decode("latin-1")]
                                                         for k, v in request.headers.raw
                                                         if k.lower() not in (b"host", b"content-length")],
                                             "body": body})
            return httpx.Response(answer["status"], headers=answer["headers"], content=answer["body"])

    return Transport()


def channel_transport(channel: Channel) -> Any:
    """An httpx transport that sends each request to the host (``http``): the rollout is the
    first segment of the URL's path (``http://model.flywheel/<rollout>/v1/...``)."""
    def where(request: Any) -> dict[str, str]:
        _, rollout, path = request.url.raw_path.decode().split("/", 2)
        return {"rollout": rollout, "path": "/" + path}

    return _transport(channel, "http", where)


def egress_transport(channel: Channel) -> Any:
    """An httpx transport that asks the host (``egress``) to make each request: environment code's
    calls to endpoints its run's config names (:mod:`flywheel.sdk.egress`)."""
    return _transport(channel, "egress", lambda request: {"url": str(request.url)})


# --- the worker -----------------------------------------------------------------------------------


@dataclass
class _Live:
    """A rollout under way here: how to stop it, its hooks."""

    stop: asyncio.Future[str]
    hooks: CallHooks


@dataclass
class _Loaded:
    """What a handle holds: an environment (None for a custom scorer's function) and its rewards by name."""

    env: Environment | None
    rewards: dict[str, Reward | GroupReward]
    info: EnvironmentInfo


@dataclass
class Worker:
    """The ops a host calls (see the module); ``channel`` is set once the channel is made."""

    channel: Channel | None = None
    loaded: dict[int, _Loaded] = field(default_factory=dict)
    live: dict[str, _Live] = field(default_factory=dict)
    _handles: Any = field(default_factory=lambda: itertools.count(1))
    _client: Any = None  # the httpx client over the channel, made on first use
    _pool: ThreadPoolExecutor | None = None
    _scorings: dict[float, Scoring] = field(default_factory=dict)

    def handlers(self) -> dict[str, Any]:
        return {"load": self.load, "unload": self.unload, "tasks": self.tasks, "prompt": self.prompt,
                "privileged": self.privileged, "references": self.references, "roll_out": self.roll_out,
                "stop": self.stop, "hook_before": self.hook_before, "hook_after": self.hook_after,
                "score": self.score, "score_group": self.score_group, "ping": self.ping}

    def _env(self, handle: int) -> Environment:
        found = self.loaded.get(handle)
        if found is None or found.env is None:
            raise LookupError(f"no environment loaded as handle {handle} in this worker")
        return found.env

    async def ping(self, _: Any) -> str:
        return "pong"

    async def load(self, args: Any) -> dict[str, Any]:
        spec = msgspec.convert(args, LoadSpec)
        if spec.function is not None:
            from flywheel.contract.config import import_object  # pydantic: only for a function given alone

            try:
                fn = import_object(spec.function)
            except ValueError as exc:
                raise EnvironmentLoadError(str(exc)) from exc  # the caller names the option
            if not callable(fn):
                raise EnvironmentLoadError(f"--function {spec.function!r}: {fn!r} is not a function")
            name = str(spec.name or getattr(fn, "__name__", ""))
            reward = (GroupReward if spec.group else Reward)(fn, weight=spec.weight, name=name)
            info = EnvironmentInfo(name=name, rewards=[RewardInfo(name=name, weight=spec.weight, group=spec.group)])
            loaded = _Loaded(None, {name: reward}, info)
        else:
            env = load_environment(spec.env_id, spec.overrides())
            rewards = {r.name: r for r in env.rewards if isinstance(r, Reward | GroupReward)}
            loaded = _Loaded(env, rewards, environment_info(env))
        handle = next(self._handles)
        self.loaded[handle] = loaded
        return {"handle": handle, "info": msgspec.to_builtins(loaded.info)}

    async def unload(self, args: Any) -> None:
        self.loaded.pop(int(args["handle"]), None)

    async def tasks(self, args: Any) -> list[dict[str, Any]]:
        return self._env(args["handle"]).load_tasks(int(args["num"]), seed=int(args["seed"]))

    async def prompt(self, args: Any) -> list[events.Message]:
        """The task's first messages; an EnvironmentLoadError when the row does not fit the task set."""
        env = self._env(args["handle"])
        env.check_task(args["task"])
        return env.prompt_messages(args["task"])

    async def privileged(self, args: Any) -> list[Any]:
        """For each task: its first messages with ``context`` first (None: without), or the error text."""
        env = self._env(args["handle"])
        context = args["context"]
        out: list[Any] = []
        for task in args["tasks"]:
            try:
                out.append(env.prompt_messages(task) if context is None else env.privileged_messages(task, context))
            except Exception as exc:  # the environment's own code: its error is this task's answer
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    async def references(self, args: Any) -> list[tuple[list[events.Message], str]]:
        """For each task (and its context, None: none): the first messages and the reference answer."""
        env = self._env(args["handle"])
        out = []
        for task, context in zip(args["tasks"], args["contexts"], strict=True):
            messages = env.prompt_messages(task) if context is None else env.privileged_messages(task, context)
            out.append((messages, env.reference_answer(task)))
        return out

    def _http_client(self) -> Any:
        if self._client is None:
            import httpx

            assert self.channel is not None
            self._client = httpx.AsyncClient(transport=channel_transport(self.channel), timeout=None)
        return self._client

    async def roll_out(self, args: Any) -> dict[str, Any]:
        """Run the harness on one task; the host concludes the outcome (:func:`flywheel.sdk.rollout.conclude`)."""
        assert self.channel is not None
        channel = self.channel
        env = self._env(args["handle"])
        rid = str(args["rollout_id"])
        base_url = f"http://{MODEL_HOST}/{rid}/v1"

        async def post(url: str, body: bytes) -> tuple[int, bytes]:
            answer = await channel.call("post", {"rollout": rid, "path": url.removeprefix(base_url), "body": body})
            return int(answer["status"]), bytes(answer["body"])

        ctx = RolloutContext(task=dict(args["task"]), base_url=base_url, api_key=str(args["api_key"]),
                             model=str(args["model"]), index=int(args["index"]), timeout_s=float(args["timeout_s"]),
                             http_client=self._http_client(), post=post, rollout_id=rid, run=str(args["run"]),
                             sandbox_client=ChannelSandboxClient(channel, rid))
        if isinstance(env.harness, ProgramHarness):
            ctx.resources[PROGRAM_RUNNER] = functools.partial(_run_program, channel, rid)
        stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.live[rid] = _Live(stop, env.call_hooks(ctx.task))
        try:
            ran = await run_only(env, ctx, float(args["timeout_s"]), stop=stop)
        finally:
            live = self.live.pop(rid)
        return {"ran": msgspec.to_builtins(ran), "flags": live.hooks.flags}

    async def stop(self, args: Any) -> bool:
        live = self.live.get(str(args["rollout_id"]))
        if live is None or live.stop.done():
            return False
        live.stop.set_result(str(args["reason"]))
        return True

    def _hooks(self, rollout_id: str) -> CallHooks:
        live = self.live.get(rollout_id)
        if live is None:
            raise LookupError(f"rollout {rollout_id} is not running in this worker")
        return live.hooks

    async def hook_before(self, args: Any) -> dict[str, Any]:
        messages = msgspec.convert(args["messages"], list[events.Message])
        try:
            out = self._hooks(str(args["rollout_id"])).before(messages)
        except Blocked as exc:
            return msgspec.to_builtins(HookOutcome(blocked=exc.reason, blocked_hook=exc.hook))
        return msgspec.to_builtins(HookOutcome(messages=None if out is messages else out))

    async def hook_after(self, args: Any) -> None:
        messages = msgspec.convert(args["messages"], list[events.Message])
        self._hooks(str(args["rollout_id"])).after(messages, msgspec.convert(args["answer"], events.Message))

    def _scoring(self, args: Any) -> Scoring:
        """The scoring core of a ``score`` call: its timeout, sync rewards on this worker's threads
        (as many as the first call said)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(int(args.get("threads") or NUM_REWARD_THREADS), thread_name_prefix="reward")
        timeout_s = float(args["timeout_s"])
        if timeout_s not in self._scorings:  # one a timeout: it remembers which inline rewards it warned of
            self._scorings[timeout_s] = Scoring(self._pool, timeout_s)
        return self._scorings[timeout_s]

    def _rewards(self, handle: int, names: Sequence[str]) -> list[Reward | GroupReward]:
        found = self.loaded.get(handle)
        if found is None:
            raise LookupError(f"nothing loaded as handle {handle} in this worker")
        missing = [n for n in names if n not in found.rewards]
        if missing:
            raise LookupError(f"{found.info.name} has no reward {missing}; it has {sorted(found.rewards)}")
        return [found.rewards[n] for n in names]

    async def score(self, args: Any) -> list[list[dict[str, Any]]]:
        """Per rollout, each named reward's outcome (in ``names``' order)."""
        rollouts = _decode_rollouts(args["rollouts"])
        rewards = self._rewards(int(args["handle"]), args["names"])
        scoring = self._scoring(args)

        async def one(rollout: events.Rollout) -> list[dict[str, Any]]:
            timed = [self._timed(scoring, reward, [rollout]) for reward in rewards]
            return [outcomes[0] for outcomes in await asyncio.gather(*timed)]

        return list(await asyncio.gather(*(one(r) for r in rollouts)))

    async def score_group(self, args: Any) -> list[list[dict[str, Any]]]:
        """Each named group reward on the whole group; per rollout, their outcomes in ``names``' order."""
        rollouts = _decode_rollouts(args["rollouts"])
        rewards = self._rewards(int(args["handle"]), args["names"])
        scoring = self._scoring(args)
        by_reward = await asyncio.gather(*(self._timed(scoring, reward, rollouts) for reward in rewards))
        return [[outcomes[i] for outcomes in by_reward] for i in range(len(rollouts))]

    async def _timed(self, scoring: Scoring, reward: Reward | GroupReward, rollouts: list[events.Rollout]
                     ) -> list[dict[str, Any]]:
        """``reward`` on ``rollouts`` (one, or a group), with the sandboxes it makes metered to them."""
        assert self.channel is not None
        started = time.perf_counter()
        scope = rollouts[0].id  # the host lets a reward's sandboxes belong to the rollouts it scores
        with metered_to(rollouts[0].run, scope if len(rollouts) == 1 else None), \
                use_client(ChannelSandboxClient(self.channel, scope)):
            outcomes = await scoring.run(reward, rollouts)
        elapsed_s = time.perf_counter() - started
        return [msgspec.to_builtins(RewardOutcome(name=reward.name, value=o.value, components=o.components,
                                                  elapsed_s=elapsed_s) if isinstance(o, Value)
                                    else RewardOutcome(name=reward.name, error=o, elapsed_s=elapsed_s))
                for o in outcomes]


async def _run_program(channel: Channel, rollout_id: str, argv: Sequence[str], env: Mapping[str, str],
                       files: Mapping[str, bytes], stdin: bytes, timeout_s: float) -> tuple[int, str, str, bool]:
    """A program harness's program, run by the host in a sandbox of its own for this rollout."""
    answer = await channel.call("program", {"rollout": rollout_id, "argv": list(argv), "env": dict(env),
                                            "files": dict(files), "stdin": stdin, "timeout_s": timeout_s})
    return int(answer["exit_code"]), str(answer["stdout"]), str(answer["stderr"]), bool(answer["timed_out"])


_rollout_decoder = msgspec.msgpack.Decoder(events.Rollout)


def _decode_rollouts(data: Sequence[bytes]) -> list[events.Rollout]:
    return [_rollout_decoder.decode(d) for d in data]


async def serve(read_fd: int, write_fd: int) -> None:
    """Serve the host on these file descriptors until it closes them."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", 0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(write_fd, "wb", 0))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)

    async def write(data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    worker = Worker()
    channel = worker.channel = Channel(reader.readexactly, write, worker.handlers())
    egress.use_transport(lambda: egress_transport(channel))
    await channel.serve()


def main() -> None:
    """The worker's entry point: the channel on the stdin and stdout it was started with; whatever
    else writes to stdout (an environment's prints) goes to stderr from here on."""
    read_fd, write_fd = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(read_fd, write_fd))


if __name__ == "__main__":
    main()
