"""harbor_tasks: Harbor task folders (the Harbor framework's format, successor of Terminal-Bench's) as a
Flywheel environment, in eval and in training.

``load_environment(path)`` reads a Harbor task folder, or a folder of them, at load: each task
is one row (``id``: the folder's name, ``instruction``, ``digest`` of the folder). Per rollout
the harness makes the task's sandbox, puts the task's environment files in its workdir, and
runs a chat agent with a ``bash`` tool there (:class:`flywheel.sdk.sandbox_tools.SandboxTools`)
until it replies without a tool call, runs out of turns or of ``[agent] timeout_sec``. Then it
runs the task's verifier, ``tests/test.sh``, in that same sandbox, from the workdir, as Harbor
runs it after its agent, and records the verdict in ``state["verifier"]``: the rewards of the
reward file the verifier wrote (``reward.json``'s numbers, else ``reward.txt``'s one number as
``reward``), its exit code, whether it timed out, its output's tail.

Why the verifier runs at the end of the rollout and not in the reward: a rollout's sandbox is
destroyed when the rollout ends, before any scorer sees it, and carrying the agent's final
workspace to a fresh sandbox would put it in the rollout's state, which travels in one bus
message (1 MiB by default) with the whole trace graph. Running it in place is what Harbor does
(the verifier sees everything the agent left, ``/tmp`` included) and costs no transfer. Its
time counts against the rollout's timeout (``rollout_timeout_s``, 600 s by default), beside
the agent's. The rows carry no files: every process that loads the environment (inference,
scorer, ``flywheel eval``) reads the same folder, by the path in ``env_args`` or from an
installed package (:func:`convert`), and a row whose ``digest`` is not the folder's (the
folder changed since the run started) is refused rather than run against other tests.

Rewards: ``verifier`` (the verifier's ``reward``; 0.0 when it ran past ``[verifier]
timeout_sec``; a reward error, never a silent zero, when it wrote no reward file, an unreadable
one, or a ``reward.json`` without ``reward``). Metrics: ``verifier_timed_out``,
``agent_timed_out``, ``num_commands``.

Carried over: instruction.md (leading canary lines dropped, as Harbor does); tests/ and
tests/test.sh with ``/tests``, ``/logs`` and ``/solution`` mapped to a fresh folder of /tmp and
the workdir to ``/work`` in the task's text files and the instruction (the sandbox writes only
``/work`` and ``/tmp``); reward.txt and reward.json, read as Harbor reads them; ``[verifier]
timeout_sec`` and ``env``; ``[agent] timeout_sec`` (the agent is stopped after the turn that
passes it); ``[environment] cpus`` and ``memory_mb`` (the sandbox's limits); of
environment/Dockerfile's last stage, ``WORKDIR``, ``ENV`` and ``COPY``/``ADD`` of environment/'s
files into the workdir; without a Dockerfile, every file of environment/ in the workdir;
solution/solve.sh (:func:`run_solution`, Harbor's oracle check).

A task whose Dockerfile has ``RUN`` steps runs in the image it builds (``build_images``, on by
default): the sandbox service builds environment/ once (``sandbox.build``, docker backend; the
local backend refuses, naming the docker backend), and the rollout's sandbox runs from that
image; its files are still put in ``/work``. reward.json's other named numbers are components
of the metric ``verifier_rewards``.

Not carried over (each task's list is logged at load): with ``build_images=False`` (or without
``RUN`` steps) the Dockerfile's ``RUN`` steps and ``FROM`` image (the sandbox's system is then
the host's ``/usr`` on the local backend, or the one ``image`` on the docker backend);
``CMD``/``ENTRYPOINT``, copies from other stages, URLs or outside the workdir;
``[environment] docker_image``; multi-container tasks (docker-compose.yaml: no services);
network policies (the sandbox has no network unless ``network=True`` and the sandbox service
allows it, so a test.sh that downloads its test tools fails there); root (one unprivileged
user; ``[agent]``/``[verifier]`` ``user``); processes that outlive a command (servers); GPUs,
MCP servers, healthchecks, host variables (``[environment] env``, ``${VAR}`` values), a
separate verifier environment, artifacts, multi-step and Windows tasks (refused), a task's own
build timeout. A verifier that runs past a sandbox's limit of one command (3600 s) is refused.

To see which tasks work in this sandbox, run their solutions (an oracle that does not reach
reward 1 here needs something above): ``await run_solution(task, client)`` for each task of
:func:`read_tasks`. The Harbor framework's own Python package is named ``harbor``, hence this
module's name, ``harbor_tasks``: the two can be installed side by side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from flywheel.contract import events
from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, RewardError, TaskSet
from flywheel.sdk.harness import ChatHarness, RolloutContext
from flywheel.sdk.sandbox import NO_SERVICE, WORKDIR, SandboxClient, SandboxError, SandboxSpec, SandboxUnavailable
from flywheel.sdk.sandbox_tools import SandboxTools, sandbox_session

from .folders import MAX_COMMAND_S, File, HarborTask, read_tasks
from .package import convert

__all__ = ["File", "HarborHarness", "HarborTask", "Verdict", "convert", "load_environment", "read_tasks",
           "run_solution", "verify"]

log = logging.getLogger(__name__)
SCHEMA = {"id": str, "instruction": str, "digest": str}
SYSTEM_PROMPT = (
    "You are doing a task in a Linux sandbox through the `bash` tool: one command per call; files and the current "
    "folder persist between calls, shell variables and background processes do not. Your working folder is /work. "
    "You are an unprivileged user (no root, no system packages){network}. When the task is done, reply without "
    "calling a tool: your work is then checked by the task's tests.")
AGENT_DEADLINE = "harbor_tasks.agent_deadline"  # ctx.resources: when the agent's [agent] timeout_sec is up
BUILD_TIMEOUT_S = 600.0  # a task's image build, by default (the sandbox service's sandbox.build_timeout_s bounds it)
STAGING = "/tmp/harbor-"  # + a fresh token: where /tests, /logs and /solution are staged
# Reads what the verifier left (run in the sandbox: its reward files and its output's tail).
READ_VERDICT = """
import json, os, sys
folder = sys.argv[1]
def read(name, limit, tail=False):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, os.path.getsize(path) - limit))
        return f.read(limit).decode("utf-8", "replace")
print(json.dumps({"reward.json": read("reward.json", 16384), "reward.txt": read("reward.txt", 1024),
                  "output": read("test-stdout.txt", 2000, tail=True) or ""}))
"""


class VerifierError(Exception):
    """The verifier left no reward this bridge can read."""


@dataclass(frozen=True)
class Verdict:
    """What a task's verifier gave: ``rewards`` by name (``reward`` the one trained on), how its
    run ended, the tail of its output, and ``error`` when it left no readable reward."""

    rewards: dict[str, float]
    exit_code: int
    timed_out: bool
    output: str
    error: str | None = None


def _number(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise VerifierError(f"reward.txt holds {text[:200]!r}, not a number") from None


def parse_rewards(reward_json: str | None, reward_txt: str | None) -> dict[str, float]:
    """The rewards as Harbor reads them: reward.json's numeric fields when there is one (its
    ``reward`` from reward.txt when it has none), else reward.txt's one number as ``reward``."""
    if reward_json is not None:
        try:
            parsed = json.loads(reward_json)
        except ValueError as exc:
            raise VerifierError(f"reward.json is not JSON ({exc}): {reward_json[:200]!r}") from None
        if not isinstance(parsed, dict):
            raise VerifierError(f"reward.json holds a {type(parsed).__name__}, not an object of named numbers")
        rewards = {k: float(v) for k, v in parsed.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if "reward" not in rewards and reward_txt is not None:
            rewards["reward"] = _number(reward_txt)
        return rewards
    if reward_txt is not None:
        return {"reward": _number(reward_txt)}
    raise VerifierError("tests/test.sh wrote no reward file (/logs/verifier/reward.txt or reward.json)")


def staging_root() -> str:
    """A folder of /tmp nothing in the sandbox can have prepared (a reward file planted early)."""
    return STAGING + secrets.token_hex(8)


async def stage(client: SandboxClient, box: str, files: Mapping[str, File], folder: str) -> None:
    """Write ``files`` (paths relative to ``folder``) into the sandbox, one request each (a
    create's files travel in one message, which large environments would not fit)."""
    for rel, f in files.items():
        await client.write_file(box, f"{folder}/{rel}", f.data, f.mode)


async def verify(client: SandboxClient, box: str, task: HarborTask) -> Verdict:
    """Run ``task``'s tests/test.sh in the sandbox ``box`` from the workdir and read its reward."""
    root = staging_root()
    logs = f"{root}/logs/verifier"
    await stage(client, box, task.staged(task.tests, root), f"{root}/tests")
    made = await client.exec(box, ["mkdir", "-p", logs, f"{root}/logs/agent"], timeout_s=30)
    if made.exit_code != 0:
        raise RuntimeError(f"harbor_tasks: task {task.id}: making the verifier's log folder failed: "
                           f"{made.stderr[-500:]}")
    run = await client.exec(box, f"bash {root}/tests/test.sh > {logs}/test-stdout.txt 2>&1", cwd=WORKDIR,
                            env=task.verifier_env, timeout_s=task.verifier_timeout_s)
    read = await client.exec(box, ["python3", "-c", READ_VERDICT, logs], timeout_s=30)
    if read.exit_code != 0:
        raise RuntimeError(f"harbor_tasks: task {task.id}: reading the verifier's files failed ({read.exit_code}): "
                           f"{read.stderr[-500:]}")
    found = json.loads(read.stdout)
    if run.timed_out:
        return Verdict({}, run.exit_code, True, found["output"])
    try:
        rewards = parse_rewards(found["reward.json"], found["reward.txt"])
    except VerifierError as exc:
        return Verdict({}, run.exit_code, False, found["output"], error=f"task {task.id}: {exc}")
    return Verdict(rewards, run.exit_code, False, found["output"])


async def run_solution(task: HarborTask, client: SandboxClient, spec: SandboxSpec | None = None,
                       build_images: bool = True) -> Verdict:
    """Harbor's oracle check: the task's solution/solve.sh in a fresh sandbox made as a
    rollout's (from ``spec``; in the task's own image where it needs one and ``build_images``),
    then its verifier. A solution that does not reach its reward here shows the task needs
    what the sandbox lacks (``task.notes(build_images)`` says what)."""
    if "solve.sh" not in task.solution:
        raise ValueError(f"harbor_tasks: task {task.id} ({task.folder}) has no solution/solve.sh")
    spec = task.sandbox_spec(spec or SandboxSpec())
    if task.image_context is not None and build_images:
        spec = msgspec.structs.replace(spec, image=await build_image(client, task))
    async with client.session(spec) as box:
        await stage(client, box, task.files, WORKDIR)
        root = staging_root()
        await stage(client, box, task.staged(task.solution, root), f"{root}/solution")
        await client.exec(box, f"bash {root}/solution/solve.sh", cwd=WORKDIR, env=task.solution_env,
                          timeout_s=min(task.agent_timeout_s or MAX_COMMAND_S, MAX_COMMAND_S))
        return await verify(client, box, task)


# --- the harness ----------------------------------------------------------------------------


async def build_image(client: SandboxClient, task: HarborTask, timeout_s: float = BUILD_TIMEOUT_S) -> str:
    """``task``'s environment/ built by the sandbox service (docker backend), within ``timeout_s``
    (and the service's own bound); its image's tag."""
    assert task.image_context is not None
    log.info("harbor_tasks: task %s needs its image: asking the sandbox service to build environment/ (%d KiB; a "
             "first build may take minutes, later ones find it)", task.id, len(task.image_context) // 1024)
    try:
        built = await client.build(task.image_context, timeout_s=timeout_s)
    except SandboxError as exc:
        if exc.kind == "unsupported":
            raise RuntimeError(f"harbor_tasks: task {task.id} needs the image its environment/Dockerfile builds "
                               f"({task.runs} RUN step{'s' * (task.runs > 1)}): {exc.error}; or load the "
                               "environment with build_images=false to run it without them") from None
        raise RuntimeError(f"harbor_tasks: task {task.id}: building its image failed ({exc.kind}): "
                           f"{exc.error}") from None
    log.info("harbor_tasks: task %s runs in image %s (%s, %.0f MB)", task.id, built.image,
             "built before" if built.cached else f"built in {built.duration_s:.0f} s", built.size_mb)
    return built.image



def agent_out_of_time(ctx: RolloutContext) -> bool:
    """The chat loop's stop condition: the task's [agent] timeout_sec is up."""
    deadline = ctx.resources.get(AGENT_DEADLINE)
    if deadline is None or asyncio.get_running_loop().time() < deadline:
        return False
    ctx.state["agent_timed_out"] = True
    return True


@dataclass
class HarborHarness:
    """Per rollout: the task's sandbox with its environment files, ``chat`` (an agent with a
    ``bash`` tool in that sandbox), then the task's verifier in the same sandbox; the verdict
    goes in ``state["verifier"]``. ``spec`` is the sandbox every task starts from; a task whose
    Dockerfile has RUN steps runs in its own image, built once (``build_images``)."""

    tasks: Mapping[str, HarborTask]
    spec: SandboxSpec
    chat: ChatHarness
    build_images: bool = True
    build_timeout_s: float = BUILD_TIMEOUT_S
    _images: dict[str, asyncio.Future[str]] = dataclasses.field(default_factory=dict)

    def initial_messages(self, env: Environment, task: dict[str, Any]) -> list[events.Message]:
        return self.chat.initial_messages(env, task)

    def task_of(self, row: Mapping[str, Any]) -> HarborTask:
        task = self.tasks.get(row.get("id", ""))
        if task is None:
            raise ValueError(f"harbor_tasks: no task {row.get('id')!r} among the {len(self.tasks)} loaded")
        if task.digest != row.get("digest"):
            raise ValueError(f"harbor_tasks: task {task.id!r}: its folder ({task.folder}) changed since this row was "
                             "made; start the run again to use what it holds now")
        return task

    async def image(self, ctx: RolloutContext, task: HarborTask) -> str:
        """The tag of ``task``'s image, built by the sandbox service once for this process's
        rollouts of it (a failed build is asked again by the next rollout)."""
        pending = self._images.get(task.digest)
        if pending is None or (pending.done() and (pending.cancelled() or pending.exception() is not None)):
            if ctx.sandbox_client is None:
                raise SandboxUnavailable(f"no sandbox service for this rollout: {NO_SERVICE}")
            pending = asyncio.ensure_future(build_image(ctx.sandbox_client, task, self.build_timeout_s))
            self._images[task.digest] = pending
        return await asyncio.shield(pending)

    async def run(self, env: Environment, ctx: RolloutContext) -> None:
        task = self.task_of(ctx.task)
        spec = task.sandbox_spec(self.spec)
        if task.image_context is not None and self.build_images:
            spec = msgspec.structs.replace(spec, image=await self.image(ctx, task))
        client, box = await sandbox_session(ctx, spec)
        await stage(client, box, task.files, WORKDIR)
        if task.agent_timeout_s is not None:
            ctx.resources[AGENT_DEADLINE] = asyncio.get_running_loop().time() + task.agent_timeout_s
        await self.chat.run(env, ctx)
        ctx.state["verifier"] = dataclasses.asdict(await verify(client, box, task))


# --- rewards: read from the verdict ---------------------------------------------------------


def _verdict(state: dict[str, Any]) -> dict[str, Any]:
    verdict = state.get("verifier")
    if not isinstance(verdict, dict):
        raise RewardError("harbor_tasks: the rollout has no verifier verdict (its harness ended before the verifier "
                          "ran)")
    return verdict


def verifier(state: dict) -> float:
    verdict = _verdict(state)
    if verdict["error"]:
        raise RewardError(f"harbor_tasks: {verdict['error']}; the verifier's output ends: {verdict['output'][-500:]!r}")
    if verdict["timed_out"]:
        return 0.0
    if "reward" not in verdict["rewards"]:
        raise RewardError(f"harbor_tasks: the verifier's reward.json has no 'reward' (it has "
                          f"{sorted(verdict['rewards'])}); combine them with a reward of your own ([rewards.verifier] "
                          "function)")
    return float(verdict["rewards"]["reward"])


def verifier_rewards(state: dict) -> float | dict[str, float]:
    """reward.json's named numbers besides ``reward``, as components (0.0 when it has none)."""
    named = {k: v for k, v in _verdict(state)["rewards"].items() if k != "reward"}
    return named or 0.0


def verifier_timed_out(state: dict) -> float:
    return float(_verdict(state)["timed_out"])


def agent_timed_out(state: dict) -> float:
    return float(bool(state.get("agent_timed_out")))


def num_commands(state: dict) -> float:
    return float(state.get("sandbox_calls", {}).get("command", 0))


def instruction(task: dict[str, Any]) -> str:
    return task["instruction"]


def load_environment(path: str, name: str = "harbor_tasks", max_turns: int = 50, command_timeout_s: float = 120.0,
                     memory_mb: int = 1024, disk_mb: int = 512, network: bool = False,
                     image: str | None = None, build_images: bool = True,
                     build_timeout_s: float = BUILD_TIMEOUT_S) -> Environment:
    """``path``: a Harbor task folder or a folder of them (absolute, or relative to each
    process's working folder); ``name``: the environment's name; ``max_turns``: model calls per
    rollout; ``command_timeout_s``: each bash call's limit; ``memory_mb`` (where a task sets
    none), ``disk_mb``, ``network`` and ``image`` (docker backend): the sandbox's.
    ``build_images``: a task whose Dockerfile has RUN steps runs in the image it builds (docker
    backend; the local backend refuses it, saying so); false: it runs in ``image`` (or the
    local sandbox) with its files carried over and its RUN steps not run. ``build_timeout_s``: the
    longest build (at most the sandbox service's setting ``sandbox.build_timeout_s``)."""
    if not 0 < build_timeout_s <= MAX_COMMAND_S:
        raise EnvironmentLoadError(f"harbor_tasks: build_timeout_s={build_timeout_s}: 0 to {MAX_COMMAND_S:g} s")
    if max_turns < 1 or not 0 < command_timeout_s <= MAX_COMMAND_S:
        raise EnvironmentLoadError(f"harbor_tasks: max_turns={max_turns}, command_timeout_s={command_timeout_s}: at "
                                   f"least 1 turn, and 0 to {MAX_COMMAND_S:g} s a command")
    spec = SandboxSpec(memory_mb=memory_mb, disk_mb=disk_mb, network=network, image=image)
    try:
        msgspec.convert(msgspec.structs.asdict(spec), SandboxSpec)
    except msgspec.ValidationError as exc:
        raise EnvironmentLoadError(f"harbor_tasks: memory_mb={memory_mb}, disk_mb={disk_mb}: {exc}") from None
    tasks = read_tasks(path)
    for task in tasks.values():
        if task.notes(build_images):
            log.warning("harbor_tasks: task %s: not carried over: %s", task.id, "; ".join(task.notes(build_images)))
    tools = SandboxTools(spec=spec, timeout_s=command_timeout_s)
    prompt = SYSTEM_PROMPT.format(network="" if network else ", no network")
    chat = ChatHarness(system_prompt=prompt, tools=tools.tools("bash"), max_turns=max_turns, stop=agent_out_of_time)
    return Environment(
        name=name,
        tasks=TaskSet.from_rows([task.row() for task in tasks.values()], schema=SCHEMA, name=f"{name} tasks"),
        harness=HarborHarness(tasks, spec, chat, build_images, build_timeout_s),
        prompt=instruction,
        rewards=[Reward(verifier), Metric(verifier_rewards), Metric(verifier_timed_out), Metric(agent_timed_out),
                 Metric(num_commands)],
        sampling={"max_tokens": 2048},
        description=f"{len(tasks)} Harbor task{'s' * (len(tasks) != 1)} from {path}",
    )
