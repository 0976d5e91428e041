"""Images built from a caller's Dockerfile (``sandbox.build``), and Harbor tasks run in theirs.

Docker tier: the session's private engine and its local Debian base image (no registry is
reached; a Dockerfile here starts FROM that image). Covers: a build and its cached second
(same tag, no second build), a sandbox made from the image, a build that fails (its output's
tail in the error), a build past its time bound and an image past its size bound (each
refused naming the setting, nothing left behind); then the acceptance of Harbor tasks with
images: a task whose Dockerfile installs the tool its test uses passes with a scripted agent
in its image, fails where the image is not built, and a second run reuses the image.
"""

from __future__ import annotations

import io
import socket
import time
from pathlib import Path

import pytest

import harbor_tasks
from flywheel.contract.bus import Bus
from flywheel.contract.settings import Settings, WorkersSettings
from flywheel.runtime.evalresults import read_results
from flywheel.runtime.evaluation import EvalConfig, run_eval
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk.sandbox import SandboxError, SandboxSpec, build_tag, context_archive
from tests.helpers import until
from tests.sandbox_fixtures import sandboxed_rollout
from tests.sandbox_service import backend_named, serving
from tests.scripted_openai import ScriptedOpenAI, ScriptEntry, tool_call

pytestmark = pytest.mark.docker

# The tool a task's Dockerfile installs: its test runs it.
TOOL = '#!/bin/sh\\nexec grep -cx -- "$1" "$2"\\n'


def context(folder: Path, dockerfile: str, **files: str) -> bytes:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        (folder / name).write_text(text)
    return context_archive(folder)


async def test_an_image_is_built_once_and_sandboxes_run_from_it(bus: Bus, tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    base = request.getfixturevalue("debian_base")
    ctx = context(tmp_path / "ctx", f"FROM {base}\nCOPY greeting.txt /opt/\nRUN chmod 644 /opt/greeting.txt "
                                    f"&& echo {time.time_ns()} > /opt/built-at\n", **{"greeting.txt": "hi\n"})
    async with backend_named("docker", request) as docker_backend, serving(bus, docker_backend, warm_pool=0) as c:
        first = await c.build(ctx)
        assert first.image == build_tag(ctx) and not first.cached and first.size_mb > 0
        second = await c.build(ctx)
        assert second.image == first.image and second.cached and second.duration_s < first.duration_s
        result = await c.run("cat /opt/greeting.txt; id -u; touch /opt/x 2>&1 | tail -1",
                             spec=SandboxSpec(image=first.image))
        assert result.stdout.splitlines()[:2] == ["hi", "65534"], result  # the sandbox's user, its read-only root
        assert "Read-only file system" in result.stdout, result
        # A build's steps are a stranger's code: no network, not even this host's loopback.
        with socket.socket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen()
            port = listening.getsockname()[1]
            probe = (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); "
                     "print('REACHED THE HOST')")
            reaching = context(tmp_path / "reach",
                               f"FROM {base}\nRUN echo {time.time_ns()} && python3 -c \"{probe}\"\n")
            with pytest.raises(SandboxError, match=r"(?s)the image build failed.*(Connection refused|unreachable)"):
                await c.build(reaching)
        failing = context(tmp_path / "bad", f"FROM {base}\nRUN echo about to fail && false\n")
        with pytest.raises(SandboxError, match=r"(?s)the image build failed: .*returned a non-zero code.*"
                                               r"about to fail") as failed:
            await c.build(failing)
        assert failed.value.kind == "failed"
    async with backend_named("docker", request) as docker_backend, \
            serving(bus, docker_backend, warm_pool=0, build_max_mb=1, build_timeout_s=3) as c:
        big = context(tmp_path / "big", f"FROM {base}\nRUN echo {time.time_ns()} > /opt/stamp\n")
        with pytest.raises(SandboxError, match=r"is \d+ MB, over this service's limit of 1 MB \(setting "
                                               r"sandbox.build_max_mb\): it was removed") as large:
            await c.build(big)
        assert large.value.kind == "too_large"
        assert not docker_backend.client.images.list(name=build_tag(big)), "the oversized image is left"
        slow = context(tmp_path / "slow", f"FROM {base}\nRUN echo {time.time_ns()}; sleep 60\n")
        started = time.monotonic()
        with pytest.raises(SandboxError, match=r"ran past 3 s \(at most setting sandbox.build_timeout_s\) and was "
                                               r"stopped"):
            await c.build(slow)
        assert time.monotonic() - started < 30
        # The engine stopped it: no step's container is left running.
        await until(lambda: not docker_backend.client.containers.list(), timeout_s=30,
                    what="the stopped build's container to go")


def harbor_task(folder: Path, base: str, install: bool) -> Path:
    """A Harbor task whose test uses ``count-words``, a tool its Dockerfile installs (or not)."""
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "instruction.md").write_text("Write how many lines of words.txt are 'flywheel' to /app/count.txt.\n")
    (folder / "task.toml").write_text("[verifier]\ntimeout_sec = 30\n")
    (folder / "environment" / "words.txt").write_text("flywheel\nwheel\nflywheel\n")
    install_tool = (f"RUN printf '{TOOL}' > /usr/local/bin/count-words && chmod 755 /usr/local/bin/count-words\n"
                    if install else "RUN true\n")
    (folder / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\nCOPY words.txt /app/\n"
                                                       + install_tool)
    # The test checks the agent's answer with the tool the image has.
    (folder / "tests" / "test.sh").write_text(
        "mkdir -p /logs/verifier\n"
        "want=$(count-words flywheel /app/words.txt) || { echo 'no count-words here'; echo 0 > "
        "/logs/verifier/reward.txt; exit 1; }\n"
        "[ \"$(cat /app/count.txt)\" = \"$want\" ] && echo 1 > /logs/verifier/reward.txt || "
        "echo 0 > /logs/verifier/reward.txt\n")
    return folder


async def test_a_harbor_task_runs_in_the_image_its_dockerfile_builds(bus: Bus, tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    base = request.getfixturevalue("debian_base")
    harbor_task(tmp_path / "with-tool" / "count", base, install=True)
    harbor_task(tmp_path / "without-tool" / "count", base, install=False)
    answer: list[ScriptEntry] = [tool_call("bash", command="grep -cx flywheel words.txt > count.txt"), "Done."]
    async with backend_named("docker", request) as docker_backend, serving(bus, docker_backend, warm_pool=0) as c:
        env = harbor_tasks.load_environment(str(tmp_path / "with-tool"), max_turns=3)
        (row,) = env.load_tasks(1)
        rollout, _ = await sandboxed_rollout(env, row, answer, c)
        assert rollout.state["verifier"]["rewards"] == {"reward": 1.0}, rollout.state["verifier"]
        wrong: list[ScriptEntry] = [tool_call("bash", command="echo 5 > count.txt"), "Done."]
        rollout, _ = await sandboxed_rollout(env, row, wrong, c, rollout_id="wrong")
        assert rollout.state["verifier"]["rewards"] == {"reward": 0.0}
        # Without the tool (its Dockerfile installs none, or the image is not built) the test cannot pass.
        for folder, build in (("without-tool", True), ("with-tool", False)):
            other = harbor_tasks.load_environment(str(tmp_path / folder), max_turns=3, build_images=build,
                                                  image=base)
            rollout, _ = await sandboxed_rollout(other, other.load_tasks(1)[0], answer, c, rollout_id=folder)
            verdict = rollout.state["verifier"]
            assert verdict["rewards"] == {"reward": 0.0} and "no count-words here" in verdict["output"], verdict
        # A second run (a new process's environment) finds the image built.
        again = harbor_tasks.load_environment(str(tmp_path / "with-tool"), max_turns=3)
        task = again.harness.tasks["count"]  # type: ignore[union-attr]
        built = await c.build(task.image_context)
        assert built.cached and built.duration_s < 5
        rollout, _ = await sandboxed_rollout(again, again.load_tasks(1)[0], answer, c, rollout_id="again")
        assert rollout.state["verifier"]["rewards"] == {"reward": 1.0}
        assert not c.manager.sessions


async def test_flywheel_eval_runs_a_task_in_its_image_through_environment_workers(
        tmp_path: Path, readable: Path, request: pytest.FixtureRequest) -> None:
    """The path of a run: the environment in its worker, the build request through the host."""
    base = request.getfixturevalue("debian_base")
    harbor_task(readable / "count", base, install=True)
    settings = Settings(workers=WorkersSettings(read_only=(str(readable),)))  # where workers read the tasks
    server = NatsServer(tmp_path / "nats").start()
    try:
        bus = await Bus.connect(server.url, name="test-harbor-images-eval")
        try:
            async with backend_named("docker", request) as docker_backend, \
                    serving(bus, docker_backend, warm_pool=0) as sandbox:
                answer = tool_call("bash", command="grep -cx flywheel words.txt > count.txt")
                with ScriptedOpenAI({"agent": [answer, "Done."] * 2}) as model:
                    cfg = EvalConfig(env="harbor_tasks", model="agent", base_url=model.base_url,
                                     out=tmp_path / "out.jsonl", num_tasks=1, num_rollouts=2, concurrency=1,
                                     env_args={"path": str(readable)})
                    summary = await run_eval(cfg, server.url, io.StringIO(), settings=settings)
                records = read_results(cfg.out)
                assert summary["num_errors"] == 0 and summary["num_reward_errors"] == 0, records
                assert [r["state"]["verifier"]["rewards"] for r in records] == [{"reward": 1.0}] * 2, records
                assert not sandbox.manager.sessions
        finally:
            await bus.close()
    finally:
        server.stop()
