"""OpenEnv environments, unmodified, as Flywheel environments: ``env = "openenv:<package>"``.

An `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment (``openenv-core``) is a
class with ``reset()``, ``step(action)`` and ``state`` over typed models: an ``Action`` the
agent sends, an ``Observation`` it gets back (with ``reward`` and ``done``); a server
(``openenv.core.env_server.create_app``) serves it over HTTP and a WebSocket session per
client. ``openenv init`` lays a package out as ``<package>/models.py`` (the action and
observation classes) and ``<package>/server/<name>_environment.py`` (the environment).

Here a rollout is one episode, played by a chat loop (:class:`flywheel.sdk.harness.ChatHarness`):

- **Reset.** The rollout starts a fresh environment (its own instance in process, or its own
  WebSocket session with ``transport = "websocket"``) and resets it with the task's ``seed``
  (and ``reset_args``); the first observation is the first user message.
- **Turns.** The system prompt gives the action's JSON schema (its fields, types and
  descriptions, from the action class; ``metadata`` left out). Each model reply is parsed into
  the action class: the reply's JSON object (the last one, fenced or bare) validated by the
  class itself. A reply that does not parse gets a message saying why (the field and what was
  wrong) and costs a turn, not the episode (metric ``invalid_actions``).
- **Observations.** Each step's observation goes back as the next user message: its fields as
  JSON (without ``done``, ``reward`` and ``metadata``), or the text itself when the observation
  has one text field.
- **Rewards.** ``reward`` is the sum of the steps' rewards (the observations' ``reward``; None
  counts 0); metrics ``steps``, ``invalid_actions`` and ``done`` (the environment ended the
  episode, rather than ``max_turns``). The rewards of each step are in ``state["openenv"]``.

The environment's code runs in its environment worker (in process), or in a server the worker
starts on its own loopback (``transport = "websocket"``: the same WebSocket session protocol a
remote OpenEnv server speaks, ``openenv.core.GenericEnvClient``), never in a service.
``openenv-core`` and the package live in the environment's own folder (``flywheel env install
openenv:<package>``).

Arguments (``[env_args]``): ``environment`` (``module:Class``; default: the one ``Environment``
subclass in ``<package>.server``), ``action`` (``module:Class``; default: the one ``Action``
subclass in ``<package>.models``), ``observation`` (likewise, for the server), ``transport``
(``inprocess`` or ``websocket``), ``max_turns`` (16), ``instructions`` (text before the action
schema in the system prompt), ``reset_args`` (keyword arguments of ``reset``), ``num_tasks``
(distinct seeds, default 1,000,000).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import inspect
import json
import pkgutil
import re
import socket
import threading
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet, import_format
from flywheel.sdk.harness import ChatHarness, RolloutContext

PREFIX = "openenv:"
STATE_KEY = "openenv"
TRANSPORTS = ("inprocess", "websocket")
FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.S)
RESOURCE = "flywheel.sdk.openenv_bridge.session"  # a rollout's environment (RolloutContext.resources)
SERVER_START_S = 30.0


def _openenv() -> Any:
    """openenv's types, or a load error saying how to install it."""
    return import_format("openenv.core.env_server.types", "openenv-core", PREFIX)


def _import(path: str, what: str) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise EnvironmentLoadError(f"{what}={path!r}: give module:Class")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise EnvironmentLoadError(f"{what}={path!r}: {exc}") from exc


def _one_subclass(module_name: str, base: type, what: str, package: str) -> type:
    """The one subclass of ``base`` defined in ``module_name`` or its submodules (a server's ``app`` aside)."""
    try:
        root = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentLoadError(f"openenv package {package!r}: no module {module_name} to find its {what} in "
                                   f"({exc}); name it: {what} = \"module:Class\"") from exc
    modules = [root]
    for info in pkgutil.iter_modules(getattr(root, "__path__", [])):
        if info.name != "app":
            modules.append(importlib.import_module(f"{module_name}.{info.name}"))
    found = {obj for m in modules for obj in vars(m).values()
             if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and obj.__module__ == m.__name__}
    if len(found) != 1:
        names = sorted(f"{c.__module__}:{c.__name__}" for c in found) or ["none"]
        raise EnvironmentLoadError(f"openenv package {package!r}: {len(found)} {what} classes in {module_name} "
                                   f"({', '.join(names)}); name one: {what} = \"module:Class\"")
    return found.pop()


def action_schema(action_cls: type[BaseModel]) -> dict[str, Any]:
    """The action's JSON schema, without the ``metadata`` every OpenEnv action has."""
    schema = dict(action_cls.model_json_schema())
    schema["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    if "required" in schema:
        schema["required"] = [k for k in schema["required"] if k != "metadata"]
    return schema


def parse_action(text: str, action_cls: type[BaseModel]) -> Any:
    """The action a reply holds: its last JSON object (fenced or bare), validated by the action
    class. ValueError saying what is wrong otherwise."""
    candidates = [m.group(1) for m in FENCED.finditer(text)]
    if not candidates:
        decoder, i = json.JSONDecoder(), text.find("{")
        while i != -1:
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                i = text.find("{", i + 1)
                continue
            candidates.append(json.dumps(value))
            i = text.find("{", end)  # past the whole object: its inner objects are not actions
    if not candidates:
        raise ValueError("no JSON object in the reply")
    try:
        value = json.loads(candidates[-1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON object does not parse: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("the action is not a JSON object")
    if "metadata" in value:
        raise ValueError("'metadata' is not the agent's to set")
    try:
        return action_cls.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}" for e in exc.errors())
        raise ValueError(problems) from None


def render(observation: Mapping[str, Any]) -> str:
    """An observation as the next user message: its fields as JSON (no done, reward, metadata),
    or its one text field's text."""
    fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(fields) == 1 and len(texts) == 1:
        return texts[0]
    return json.dumps(fields, ensure_ascii=False, default=str)


class _InProcess:
    """A rollout's own instance of the environment class."""

    def __init__(self, env_cls: type) -> None:
        self.env = env_cls()

    async def reset(self, **kwargs: Any) -> tuple[dict[str, Any], float | None, bool]:
        obs = await self.env.reset_async(**kwargs)
        return obs.model_dump(), obs.reward, bool(obs.done)

    async def step(self, action: Any) -> tuple[dict[str, Any], float | None, bool]:
        obs = await self.env.step_async(action)
        return obs.model_dump(), obs.reward, bool(obs.done)

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result


class _Session:
    """A rollout's own WebSocket session with the worker's server (openenv's generic client)."""

    def __init__(self, url: str) -> None:
        # imported here: openenv-core is in the environment's own folder, on its worker's path only
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=url)

    async def reset(self, **kwargs: Any) -> tuple[dict[str, Any], float | None, bool]:
        result = await self.client.reset(**kwargs)
        return dict(result.observation), result.reward, bool(result.done)

    async def step(self, action: Any) -> tuple[dict[str, Any], float | None, bool]:
        result = await self.client.step(action.model_dump(exclude={"metadata"}))
        return dict(result.observation), result.reward, bool(result.done)

    async def close(self) -> None:
        await self.client.close()


class _Server:
    """The environment served on this worker's loopback (openenv's ``create_app``), started once."""

    def __init__(self, env_cls: type, action_cls: type, observation_cls: type) -> None:
        self.args = (env_cls, action_cls, observation_cls)
        self.url: str | None = None
        self._lock = threading.Lock()

    def start(self) -> str:
        with self._lock:
            if self.url is None:
                # imported here: uvicorn serves only this transport
                import uvicorn

                # imported here: openenv-core is in the environment's own folder, on its worker's path only
                from openenv.core.env_server.http_server import create_app

                env_cls, action_cls, observation_cls = self.args
                app = create_app(env_cls, action_cls, observation_cls, max_concurrent_envs=1024)
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
                server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
                thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                          name="openenv-server")
                thread.start()
                for _ in range(int(SERVER_START_S * 20)):
                    if server.started:
                        break
                    threading.Event().wait(0.05)
                else:
                    raise RuntimeError(f"the OpenEnv server did not start within {SERVER_START_S:.0f} s")
                self.url = f"http://127.0.0.1:{port}"
        return self.url


def load_environment(package: str, environment: str | None = None, action: str | None = None,
                     observation: str | None = None, transport: str = "inprocess", max_turns: int = 16,
                     instructions: str = "", reset_args: Mapping[str, Any] | None = None,
                     num_tasks: int = 1_000_000) -> Environment:
    """The OpenEnv environment of ``package`` (its distribution or module name) as a Flywheel environment."""
    package = package.replace("-", "_")
    types = _openenv()
    # imported here: openenv-core is in the environment's own folder, on its worker's path only
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment

    if transport not in TRANSPORTS:
        raise EnvironmentLoadError(f"transport={transport!r}: use one of {', '.join(TRANSPORTS)}")
    env_cls = (_import(environment, "environment") if environment
               else _one_subclass(f"{package}.server", OpenEnvEnvironment, "environment", package))
    action_cls = (_import(action, "action") if action
                  else _one_subclass(f"{package}.models", types.Action, "action", package))
    observation_cls = (_import(observation, "observation") if observation
                       else _one_subclass(f"{package}.models", types.Observation, "observation", package))
    schema = action_schema(action_cls)
    system = (f"{instructions.strip()}\n\n" if instructions.strip() else "") + (
        "You act in an environment. Each reply is one action: a JSON object matching this schema (you may think "
        f"first; the last JSON object of the reply is the action):\n{json.dumps(schema)}")
    server = _Server(env_cls, action_cls, observation_cls) if transport == "websocket" else None
    resets = dict(reset_args or {})

    async def setup(task: dict[str, Any], state: dict[str, Any], ctx: RolloutContext,
                    messages: list[dict[str, Any]]) -> None:
        if server is not None:
            session: _InProcess | _Session = _Session(await asyncio.to_thread(server.start))
        else:
            session = _InProcess(env_cls)
        ctx.resources[RESOURCE] = session
        ctx.on_close(session.close)
        observation, reward, done = await session.reset(seed=int(task["seed"]), **resets)
        state[STATE_KEY] = {"rewards": [] if reward is None else [float(reward)], "done": done, "steps": 0,
                            "invalid_actions": 0}
        messages.append({"role": "user", "content": render(observation)})

    async def respond(messages: list[dict[str, Any]], state: dict[str, Any], ctx: RolloutContext) -> str | None:
        record = state[STATE_KEY]
        if record["done"]:
            return None
        try:
            act = parse_action(messages[-1].get("content") or "", action_cls)
        except ValueError as exc:
            record["invalid_actions"] += 1
            return f"That is not an action: {exc}. Reply with one JSON object matching the schema."
        observation, reward, done = await ctx.resources[RESOURCE].step(act)
        record["steps"] += 1
        record["rewards"].append(0.0 if reward is None else float(reward))
        record["done"] = done
        return None if done else render(observation)

    def episode(state: Mapping[str, Any]) -> dict[str, Any]:
        found = state.get(STATE_KEY)
        if not isinstance(found, dict):
            raise ValueError(f"the rollout's state holds no OpenEnv episode ({STATE_KEY!r} missing): it never reset")
        return found

    def reward(state: dict[str, Any]) -> float:
        return float(sum(episode(state)["rewards"]))

    def seeds(num: int, seed: int) -> list[dict[str, Any]]:
        return [{"seed": (seed * 7919 + i) % num_tasks} for i in range(num)]

    seeds.__qualname__ = f"openenv_{package}"
    return Environment(
        name=package.replace("-", "_").replace(".", "_"),
        tasks=TaskSet.from_generator(seeds, schema={"seed": int}),
        harness=ChatHarness(system_prompt=system, max_turns=max_turns, setup=setup, env_response=respond),
        prompt=lambda row: [],
        rewards=[Reward(reward, name="reward"),
                 Metric(lambda state: float(episode(state)["steps"]), name="steps"),
                 Metric(lambda state: float(episode(state)["invalid_actions"]), name="invalid_actions"),
                 Metric(lambda state: float(episode(state)["done"]), name="done")],
        version=_version(package),
        description=f"OpenEnv environment {package} ({transport}, through the OpenEnv bridge)",
    )


def _version(package: str) -> str:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(package.replace("_", "-"))
    return "0.0.0"
