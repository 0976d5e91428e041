"""verifiers environments, unmodified, as Flywheel environments: ``env = "verifiers:<taskset id>"``.

`verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ (v1 API, ``import verifiers.v1 as
vf``) packages an environment as a *taskset*: a ``Taskset`` subclass exported in the package's
``__all__`` whose ``load()`` yields ``Task`` objects, each with its data (``TaskData``: prompt,
system prompt, the task's own fields) and its scoring (``@vf.reward(weight=...)`` and
``@vf.metric`` methods, judges); tools are MCP servers (``vf.Toolset``); a *harness* program
plays each rollout (the ``null`` harness is a plain chat loop with the task's tools) in a
*runtime* (a subprocess, a container, a remote sandbox), its model calls going through
verifiers' interception server to an OpenAI-compatible endpoint.

Here, each part keeps its own code:

- **Tasks.** The worker loads the taskset and turns each task into a row: its wire data
  (``TaskData.model_dump(mode="json")``, its position ``idx`` included). A task set that never ends
  (``INFINITE``) is read as far as a run asks.
- **Rollouts.** One rollout is one verifiers episode, run by verifiers itself
  (``Env.run_slot``) in a program sandbox of its own (:class:`flywheel.sdk.harness.ProgramHarness`:
  no network; its one way out is the rollout's model endpoint). The episode's model client is
  that endpoint, so every model call of the harness goes through Flywheel's interception and
  training gets the exact tokens. The runtime is forced to Flywheel's (:class:`FlywheelRuntime`,
  processes inside that sandbox; a verifiers PEP 723 program runs with the environment's own
  Python, whose packages hold what it declares, instead of being provisioned by ``uv`` over the
  network); a task or runtime that needs a container image is refused with a message saying so.
- **Rewards.** verifiers scores the episode with the task's own functions, in the episode; the
  rollout's state carries the trace's rewards, metrics and errors (``state["verifiers"]``). The
  Flywheel reward ``verifiers`` has one component per verifiers reward (its score, weighted by
  its ``@vf.reward`` weight: the total is verifiers' ``trace.reward``); each verifiers metric is
  a metric of its name (one that returns a dict: the keys no other metric is named). An episode
  verifiers marks failed (a provider error, a harness or scoring error, a timeout) is the
  rollout's error, with verifiers' message.

verifiers and the taskset's package live in the environment's own folder (``flywheel env install
verifiers:<package>``), never in the services' environment: verifiers pins versions the services
do not use (``mcp``), and a worker puts that folder first on its path.

Arguments (``[env_args]``): ``taskset`` (the taskset config's fields, as ``--env.taskset.*``
would give them), ``harness`` (the harness config; default ``{"id": "null"}``: a plain chat;
``{}`` takes the taskset's own), ``agent`` (other fields of the agent config: ``max_turns``,
``timeout``...), ``timeout_s`` (a rollout's limit, default 600).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet, import_format
from flywheel.sdk.harness import ProgramHarness

PREFIX = "verifiers:"
STATE_KEY = "verifiers"
CONFIG_VAR = "FLYWHEEL_VERIFIERS_CONFIG"  # the episode program's env config (JSON)
DEFAULT_HARNESS = {"id": "null"}
MAX_STATE_CHARS = 20_000  # of an error's text kept in the state
MAX_TRACE_CHARS = 256 * 1024  # a verifiers trace longer than this stays out of the state


def _vf() -> Any:
    """verifiers.v1, or a load error saying how to install it."""
    return import_format("verifiers.v1", "verifiers", PREFIX)


def env_config(taskset_id: str, taskset: Mapping[str, Any] | None = None, harness: Mapping[str, Any] | None = None,
               agent: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verifiers env config (the ``[env]`` block verifiers reads) of a taskset with Flywheel's runtime."""
    role = {**dict(agent or {}), "runtime": {"type": "subprocess"}}
    chosen = DEFAULT_HARNESS if harness is None else dict(harness)
    if chosen:
        role["harness"] = chosen
    return {"taskset": {**dict(taskset or {}), "id": taskset_id}, "agent": role}


def build_env(config: Mapping[str, Any]) -> Any:
    """The verifiers ``Env`` of ``config``, its runtimes Flywheel's (:func:`force_runtime`)."""
    _vf()
    # imported here: verifiers is in the environment's own folder, on its worker's path only
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    force_runtime()
    try:
        env = load_environment(resolve_env_config(dict(config)))
    except (ModuleNotFoundError, TypeError, ValueError, AttributeError) as exc:
        raise EnvironmentLoadError(f"verifiers taskset {config['taskset']['id']!r}: {exc}") from exc
    for name, spec in env._agent_specs.items():  # every role runs here, in Flywheel's runtime
        if getattr(spec.runtime, "type", "subprocess") != "subprocess":
            raise EnvironmentLoadError(f"verifiers taskset {config['taskset']['id']!r}: role {name!r} asks for the "
                                       f"{spec.runtime.type} runtime; here a verifiers episode runs in Flywheel's "
                                       "sandbox (the subprocess runtime)")
    if getattr(env._task_cls, "NEEDS_CONTAINER", False):
        raise EnvironmentLoadError(f"verifiers taskset {config['taskset']['id']!r}: its tasks need a container image "
                                   "(NEEDS_CONTAINER); the verifiers bridge runs episodes in a sandbox without one")
    return env


def _rows(taskset: Any) -> Iterator[dict[str, Any]]:
    for task in taskset:
        if task.data.image:
            raise EnvironmentLoadError(f"verifiers task {task.data.idx} names the container image {task.data.image!r}; "
                                       "the verifiers bridge runs episodes in a sandbox without images")
        yield task.data.model_dump(mode="json")


def _signal_names(env: Any) -> tuple[dict[str, float], list[str]]:
    """The task class's reward names with their weights, and its metric names (by instantiating
    one task: plugged functions are in its config)."""
    first = next(iter(env.taskset.take(1)), None)
    if first is None:
        raise EnvironmentLoadError(f"verifiers taskset {env.config.taskset.id!r} loads no task")
    weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in first.hooks("reward")}
    for judge in first.plugged_judges():
        weights[judge.reward_name] = float(judge.config.weight)
    return weights, [fn.__name__ for fn in first.hooks("metric")]


def load_environment(taskset_id: str, taskset: Mapping[str, Any] | None = None,
                     harness: Mapping[str, Any] | None = None, agent: Mapping[str, Any] | None = None,
                     timeout_s: float = 600.0) -> Environment:
    """The verifiers taskset ``taskset_id`` (its package's id, as ``vf-eval`` takes it) as an environment."""
    config = env_config(taskset_id, taskset, harness, agent)
    env = build_env(config)
    weights, metric_names = _signal_names(env)
    if env.taskset.bounded:
        rows = list(_rows(env.taskset))
        if not rows:
            raise EnvironmentLoadError(f"verifiers taskset {taskset_id!r} loads no task")
        tasks = TaskSet.from_rows(rows, name=taskset_id)
    else:
        def generate(num: int, seed: int) -> list[dict[str, Any]]:
            return list(_rows(env.taskset.take(num)))  # an infinite taskset: its first num (it owns its randomness)

        generate.__qualname__ = f"verifiers_{taskset_id}"
        tasks = TaskSet.from_generator(generate)

    def prompt(row: dict[str, Any]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if row.get("system_prompt"):
            messages.append({"role": "system", "content": row["system_prompt"]})
        given = row.get("prompt")
        if isinstance(given, str):
            messages.append({"role": "user", "content": given})
        elif isinstance(given, list):
            messages.extend(given)
        return messages

    def verifiers_reward(state: dict[str, Any]) -> dict[str, float]:
        found = _episode(state)
        # Each reward's score; one a function recorded under a name of its own (a dict result) is
        # counted at its value (score x weight) with weight 1: the sum is verifiers' trace.reward.
        return {name: float(r["score"]) if name in weights else float(r["score"]) * float(r["weight"])
                for name, r in found["rewards"].items() if r is not None}

    def metric(name: str) -> Reward:
        def verifiers_metric(state: dict[str, Any]) -> float | dict[str, float]:
            found = _episode(state)["metrics"]
            if name in found:
                return float(found[name])
            # A metric function that returned a dict recorded its keys instead of its name.
            return {key: float(v) for key, v in found.items() if key not in metric_names}

        return Metric(verifiers_metric, name=name if name != "verifiers" else "verifiers_metric")

    program = ProgramHarness(argv=["{python}", "-m", __name__], env={CONFIG_VAR: json.dumps(config)},
                             timeout_s=timeout_s)
    return Environment(
        name=taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").replace(".", "_"),
        tasks=tasks,
        harness=program,
        prompt=prompt,
        rewards=[Reward(verifiers_reward, name="verifiers", weights=weights), *map(metric, metric_names)],
        version=_version(taskset_id),
        description=f"verifiers taskset {taskset_id} (through the verifiers bridge)",
    )


def _episode(state: Mapping[str, Any]) -> dict[str, Any]:
    found = state.get(STATE_KEY)
    if not isinstance(found, dict) or not isinstance(found.get("rewards"), dict):
        raise ValueError(f"the rollout's state holds no verifiers episode ({STATE_KEY!r} missing): its program did "
                         "not finish")
    return found


def _version(taskset_id: str) -> str:
    name = taskset_id.rsplit("/", 1)[-1].split("@", 1)[0]
    try:
        return f"{importlib.metadata.version(name)}+verifiers.{importlib.metadata.version('verifiers')}"
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


# --- Flywheel's runtime for verifiers ---------------------------------------------------------------

def force_runtime() -> None:
    """Make every runtime verifiers provisions in this process a ``FlywheelRuntime``."""
    # imported here: verifiers is in the environment's own folder, on its worker's path only
    import verifiers.v1.runtimes as runtimes

    if getattr(runtimes._runtime_cls, "flywheel", False):
        return
    # imported here: as above
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    class FlywheelRuntime(SubprocessRuntime):
        """verifiers' subprocess runtime, inside Flywheel's sandbox: a PEP 723 program runs with
        this Python (the environment's folder holds what verifiers' programs declare) instead
        of an environment ``uv`` would build from the network, which the sandbox has not."""

        async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *,
                                    activate: bool = True) -> list[str]:
            data = script.encode() if isinstance(script, str) else script
            missing = _missing_dependencies(data)
            if missing:
                raise RuntimeError(f"a verifiers program needs {', '.join(missing)}, not installed for this "
                                   "environment: add them to the taskset package's dependencies")
            path = Path(str(self.workdir), ".scripts", f"{hashlib.sha256(data).hexdigest()}.py")
            path.parent.mkdir(exist_ok=True)
            await asyncio.to_thread(path.write_bytes, data)
            return [sys.executable, str(path)]

    def runtime_class(config: Any) -> type:
        if not isinstance(config, SubprocessConfig):
            raise RuntimeError(f"the {config.type} runtime is not available here: a verifiers episode runs in "
                               "Flywheel's sandbox (the subprocess runtime)")
        return FlywheelRuntime

    runtime_class.flywheel = True  # type: ignore[attr-defined]  # the mark this function checks
    runtimes._runtime_cls = runtime_class


def _missing_dependencies(script: bytes) -> list[str]:
    """The PEP 723 ``dependencies`` of ``script`` that this Python does not satisfy."""
    # imported here: the hub's HTTP client only in a verifiers program
    from flywheel.sdk.hub import unsatisfied

    block = re.search(rb"^# /// script\s*$(.*?)^# ///\s*$", script, re.S | re.M)
    if block is None:
        return []
    text = "\n".join(line.removeprefix("#").removeprefix(" ") for line in block.group(1).decode().splitlines())
    return unsatisfied(tomllib.loads(text).get("dependencies", []))


# --- the episode program ------------------------------------------------------------------------------

async def run_episode(config: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """One verifiers episode of the task ``row`` against the endpoint in ``OPENAI_BASE_URL``;
    returns what the rollout's state keeps (``state["verifiers"]``)."""
    # imported here: verifiers is in the environment's own folder, on its worker's path only
    from verifiers.v1.clients import EvalClientConfig, ModelContext

    env = build_env(config)
    idx = row.get("idx")
    task = None
    for candidate in env.taskset:
        if candidate.data.idx == idx:
            task = candidate
            break
    data = None if task is None else task.data.model_dump(mode="json")
    if data is None or any(row.get(k) != v for k, v in data.items()):
        raise RuntimeError(f"verifiers taskset {config['taskset']['id']!r} has no task {idx} with this row's data "
                           "(another version of the taskset, or another config)")
    ctx = ModelContext(model=os.environ["OPENAI_MODEL"],
                       client=EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY"))
    async with env.serving():
        episode = await env.run_slot(env.slots(task)[0], ctx)
    traces = list(episode.traces)
    trace = traces[0] if traces else None
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    if trace is not None:
        errors += [f"{e.type}: {e.message}" for e in trace.errors]
    return {"ok": bool(episode.ok), "errors": errors,
            "stop_condition": getattr(trace, "stop_condition", None),
            "rewards": {} if trace is None else {name: None if r is None else {"score": r.score, "weight": r.weight}
                                                  for name, r in trace.rewards.items()},
            "metrics": {} if trace is None else dict(trace.metrics),
            "num_traces": len(traces),
            # The whole trace, for whoever checks the scoring again (verifiers' own Trace JSON);
            # left out when longer than the state should carry.
            "trace": None if trace is None or len(text := trace.model_dump_json()) > MAX_TRACE_CHARS
            else json.loads(text)}


def main() -> int:
    """The program of a rollout: the task's row on stdin, the env config in ``FLYWHEEL_VERIFIERS_CONFIG``;
    the last stdout line is the state (``{"verifiers": ...}``); exit 1 when verifiers failed the episode."""
    config = json.loads(os.environ[CONFIG_VAR])
    row = json.loads(sys.stdin.read())
    found = asyncio.run(run_episode(config, row))
    print(json.dumps({STATE_KEY: found}), flush=True)
    if not found["ok"]:
        print(f"verifiers failed the episode ({found['stop_condition']}): "
              f"{'; '.join(found['errors'])[:MAX_STATE_CHARS] or 'no error recorded'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
