"""harbor_tasks: Harbor task folders (tests/tasks: a file to write, a word to count with reward.json)
read into rows, malformed folders refused naming the folder and the field, the Dockerfile and
path mapping; against a real sandbox service (local backend) over a real nats-server: each
task's solution reaches reward 1 and an untouched workspace 0, rollouts through the harness
and a scripted model are rewarded by the task's own test.sh, a verifier that writes no reward
is a reward error and one past its timeout a 0; convert() writes a package that loads."""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import harbor_tasks
from flywheel.contract.bus import Bus
from flywheel.runtime.evalresults import read_results
from flywheel.runtime.evaluation import EvalConfig, run_eval
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk.environment import EnvironmentLoadError, RewardError, load_environment, resolve
from flywheel.sdk.sandbox import WORKDIR, SandboxSpec, context_archive
from flywheel.sdk.sandbox_tools import SandboxUnavailable
from harbor_tasks.folders import map_paths, read_environment, read_task
from tests.sandbox_fixtures import sandboxed_rollout
from tests.sandbox_service import ServedSandboxClient, backend_named, serving
from tests.scripted_openai import ScriptedOpenAI, ScriptEntry, tool_call

TASKS = Path(__file__).parent / "tasks"


@pytest.fixture(scope="module")
def env():
    # The local sandbox: the tasks' RUN steps (apt-get, pip: network) are not run, as they need not be here.
    return harbor_tasks.load_environment(str(TASKS), max_turns=4, build_images=False)


@pytest.fixture(scope="module")
def rows(env) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in env.load_tasks(env.tasks.size)}


def make_task(folder: Path, test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", toml: str = "",
              instruction: str = "Do it.\n") -> Path:
    """A minimal task folder."""
    (folder / "tests").mkdir(parents=True)
    (folder / "instruction.md").write_text(instruction)
    (folder / "task.toml").write_text(toml)
    (folder / "tests" / "test.sh").write_text("mkdir -p /logs/verifier\n" + test_sh)
    return folder


# --- reading task folders -------------------------------------------------------------------


def test_load_reads_each_task_folder_into_a_row(env, rows) -> None:
    assert set(rows) == {"hello-file", "word-count"}
    hello = rows["hello-file"]
    assert hello["instruction"] == f"Create a file named `hello.txt` in `{WORKDIR}` whose only line is `Hello`.\n"
    system, user = env.prompt_messages(hello)
    assert "bash" in system.content and WORKDIR in system.content and user.content == hello["instruction"]
    assert f"{WORKDIR}/data/words.txt" in rows["word-count"]["instruction"]
    assert env.weights == {"verifier": 1.0, "verifier_rewards": 0.0, "verifier_timed_out": 0.0, "agent_timed_out": 0.0,
                           "num_commands": 0.0}
    single = harbor_tasks.load_environment(str(TASKS / "hello-file"))
    assert [row["id"] for row in single.load_tasks(1)] == ["hello-file"]
    assert resolve("harbor_tasks") is harbor_tasks.load_environment  # module name; flywheel/harbor-tasks: entry point


def test_what_a_task_carries_over_and_what_it_does_not() -> None:
    task = harbor_tasks.read_tasks(TASKS)["word-count"]
    assert task.workdir == "/app" and task.env == {"TARGET_WORD": "flywheel"}
    assert sorted(task.files) == ["NOTES.md", "data/words.txt"]
    assert task.files["data/words.txt"].data.count(b"flywheel\n") == 3
    assert task.verifier_env == {"EXPECTED": "3"} and task.verifier_timeout_s == 20 and task.agent_timeout_s == 300
    assert f"{WORKDIR}/count.txt" in task.tests["test.sh"].data.decode()
    staged = task.staged(task.tests, "/tmp/harbor-x")["test.sh"].data.decode()
    assert "/tmp/harbor-x/logs/verifier/reward.json" in staged and "/logs/verifier" not in staged.replace(
        "/tmp/harbor-x/logs/verifier", "")
    notes = " | ".join(task.notes(build_images=False))
    for said in ("docker_image", "1 RUN instruction not run (build_images=false)", "CMD", "JUDGE_KEY"):
        assert said in notes, (said, notes)
    # Built, the image holds what RUN installs: environment/ is kept as its build context.
    assert "RUN" not in " | ".join(task.notes(build_images=True)) and task.runs == 1
    assert task.image_context == context_archive(TASKS / "word-count" / "environment")
    hello = harbor_tasks.read_tasks(TASKS)["hello-file"]
    assert (hello.cpus, hello.memory_mb, hello.files) == (1, 512, {})
    assert hello.sandbox_spec(SandboxSpec(memory_mb=2048)).memory_mb == 512


def test_a_dockerfile_last_stage_is_followed(tmp_path: Path) -> None:
    context = tmp_path / "t" / "environment"
    (context / "src" / "pkg").mkdir(parents=True)
    (context / "src" / "pkg" / "mod.py").write_text("X = '/app/data'\n")
    (context / "run.sh").write_text("#!/bin/sh\ncd /app && ls\n")
    (context / "run.sh").chmod(0o755)
    (context / "a.csv").write_text("1\n")
    (context / "b.csv").write_text("2\n")
    (context / "Dockerfile").write_text(
        "FROM debian AS build\nWORKDIR /elsewhere\nCOPY run.sh /elsewhere/\n"
        "FROM debian\n"
        "# a comment\n"
        "WORKDIR /srv\nWORKDIR project\n"
        "ENV A=1 B=\"two words\"\nENV OLD old form\nENV PATH=/opt/bin:$PATH\n"
        "COPY src/ ./src\n"
        "COPY [\"run.sh\", \"bin/\"]\n"
        "COPY --chown=1000 *.csv data/\n"
        "COPY a.csv .\n"
        "COPY --from=build /elsewhere/run.sh /usr/bin/\n"
        "ADD https://example.com/x.tar.gz /srv/project/\n"
        "COPY a.csv /etc/a.csv\n"
        "RUN apt-get update \\\n  && apt-get install -y curl\n"
        "RUN <<EOF\nCOPY not an instruction\nEOF\n")
    workdir, files, envs, notes, runs = read_environment(tmp_path / "t", "here")
    assert workdir == "/srv/project" and runs == 2
    assert sorted(files) == ["a.csv", "bin/run.sh", "data/a.csv", "data/b.csv", "src/pkg/mod.py"]
    assert files["bin/run.sh"].mode == 0o755
    assert envs == {"A": "1", "B": "two words", "OLD": "old form"}
    text = " | ".join(notes)
    for said in ("ENV PATH", "--from=build", "https://example.com/x.tar.gz", "/etc/a.csv"):
        assert said in text, (said, text)
    (context / "Dockerfile").write_text("FROM debian\nWORKDIR /app\nCOPY missing.txt .\n")
    with pytest.raises(EnvironmentLoadError, match=r"here: environment/Dockerfile copies 'missing.txt'"):
        read_environment(tmp_path / "t", "here")
    (context / "Dockerfile").unlink()  # no Dockerfile: environment/ goes to the workdir as it is
    workdir, files, envs, notes, runs = read_environment(tmp_path / "t", "here")
    assert workdir == "/app" and sorted(files) == ["a.csv", "b.csv", "run.sh", "src/pkg/mod.py"]


@pytest.mark.parametrize(("text", "mapped"), [
    ("cat /app/x.txt", f"cat {WORKDIR}/x.txt"),
    ("cd /app; ls /app/", f"cd {WORKDIR}; ls {WORKDIR}/"),
    ("Write it to /app.", f"Write it to {WORKDIR}."),
    ("`/app` and \"/app/a b\"", f"`{WORKDIR}` and \"{WORKDIR}/a b\""),
    ("/apple /app.tar /x/app ./app ~/app $HOME/app", "/apple /app.tar /x/app ./app ~/app $HOME/app"),
    ("python3 /tests/test_outputs.py > /logs/verifier/out", "python3 /T/tests/test_outputs.py > /T/logs/verifier/out"),
])
def test_paths_are_mapped_by_whole_components(text: str, mapped: str) -> None:
    assert map_paths(text, {"/app": WORKDIR, "/tests": "/T/tests", "/logs": "/T/logs"}) == mapped


@pytest.mark.parametrize(("breaks", "said"), [
    (lambda f: (f / "instruction.md").unlink(), r"no instruction\.md"),
    (lambda f: (f / "task.toml").unlink(), r"no task\.toml"),
    (lambda f: (f / "task.toml").write_text("[verifier\ntimeout_sec = 1\n"), r"task\.toml does not parse"),
    (lambda f: (f / "task.toml").write_text("[verifier]\ntimeout_sec = \"soon\"\n"),
     r"task\.toml \[verifier\] timeout_sec: Input should be a valid number"),
    (lambda f: (f / "task.toml").write_text("[agent]\ntimeout_sec = -5\n"), r"\[agent\] timeout_sec: Input should be"),
    (lambda f: (f / "task.toml").write_text("[verifier]\ntimeout_sec = 7200\n"),
     r"\[verifier\] timeout_sec: Input should be less than or equal to 3600"),
    (lambda f: (f / "task.toml").write_text("[environment]\nos = \"windows\"\n"), r"\[environment\] os: Input should"),
    (lambda f: (f / "task.toml").write_text("[environment]\nmemory_mb = 999999\n"),
     r"\[environment\] cpus=None, memory_mb=999999: more than a sandbox takes"),
    (lambda f: (f / "task.toml").write_text("[[steps]]\nname = \"one\"\n"), r"\[steps\]: multi-step tasks"),
    (lambda f: (f / "tests" / "test.sh").unlink(), r"no tests/test\.sh"),
])
def test_a_malformed_task_folder_is_refused_naming_it_and_the_field(tmp_path: Path, breaks, said: str) -> None:
    shutil.copytree(TASKS, tmp_path / "tasks")
    broken = tmp_path / "tasks" / "word-count"
    breaks(broken)
    with pytest.raises(EnvironmentLoadError, match=rf"harbor_tasks: task folder {broken}: .*{said}"):
        harbor_tasks.load_environment(str(tmp_path / "tasks"))


def test_a_path_without_tasks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentLoadError, match="is not a folder"):
        harbor_tasks.load_environment(str(tmp_path / "nowhere"))
    with pytest.raises(EnvironmentLoadError, match="holds no task folders"):
        harbor_tasks.load_environment(str(tmp_path))
    with pytest.raises(EnvironmentLoadError, match="max_turns=0"):
        harbor_tasks.load_environment(str(TASKS), max_turns=0)


def test_a_row_from_another_version_of_the_folder_is_refused(env, rows) -> None:
    assert isinstance(env.harness, harbor_tasks.HarborHarness)
    assert env.harness.task_of(rows["hello-file"]).id == "hello-file"
    with pytest.raises(ValueError, match="changed since this row was made"):
        env.harness.task_of({**rows["hello-file"], "digest": "0" * 64})
    with pytest.raises(ValueError, match="no task 'gone'"):
        env.harness.task_of({"id": "gone"})


# --- in a real sandbox ----------------------------------------------------------------------


async def test_each_solution_reaches_its_reward_and_an_untouched_workspace_does_not(
        sandbox: ServedSandboxClient) -> None:
    tasks = harbor_tasks.read_tasks(TASKS)
    hello, count = [await harbor_tasks.run_solution(tasks[name], sandbox, build_images=False)
                    for name in ("hello-file", "word-count")]
    assert hello.rewards == {"reward": 1.0} and hello.error is None and not hello.timed_out
    assert count.rewards == {"reward": 1.0, "off_by": 0.0}
    for task in tasks.values():
        async with sandbox.session(task.sandbox_spec(SandboxSpec())) as box:
            await harbor_tasks.stage(sandbox, box, task.files, f"{WORKDIR}")
            verdict = await harbor_tasks.verify(sandbox, box, task)
        assert verdict.rewards["reward"] == 0.0 and verdict.error is None, task.id
    assert not sandbox.manager.sessions


async def rewards(env, rollout) -> dict[str, float]:
    return {name: (await r(rollout)).value for name, r in env.rollout_rewards.items()}


async def test_rollouts_are_rewarded_by_the_task_own_verifier(env, rows, sandbox: ServedSandboxClient) -> None:
    right: list[ScriptEntry] = [tool_call("bash", command="ls -a; echo Hello > hello.txt"), "Done."]
    rollout, server = await sandboxed_rollout(env, rows["hello-file"], right, sandbox)
    assert [t["function"]["name"] for t in server.requests_for("agent")[0]["tools"]] == ["bash"]
    assert rollout.state["verifier"]["rewards"] == {"reward": 1.0}
    assert await rewards(env, rollout) == {"verifier": 1.0, "verifier_rewards": 0.0, "verifier_timed_out": 0.0,
                                           "agent_timed_out": 0.0, "num_commands": 1.0}
    wrong: list[ScriptEntry] = [tool_call("bash", command="echo Goodbye > hello.txt"), "Done."]
    rollout, _ = await sandboxed_rollout(env, rows["hello-file"], wrong, sandbox)
    assert (await rewards(env, rollout))["verifier"] == 0.0
    counted: list[ScriptEntry] = [tool_call("bash", command="grep -cx \"$TARGET_WORD\" data/words.txt > count.txt"),
                                  "3 lines."]
    rollout, _ = await sandboxed_rollout(env, rows["word-count"], counted, sandbox)
    assert rollout.state["verifier"]["rewards"] == {"reward": 1.0, "off_by": 0.0}
    assert (await rewards(env, rollout))["verifier"] == 1.0
    # reward.json's other named numbers are components.
    assert (await env.rollout_rewards["verifier_rewards"](rollout)).components == {"off_by": 0.0}
    assert not sandbox.manager.sessions  # each rollout's sandbox ended with it


async def test_the_agent_is_stopped_at_its_timeout_and_still_verified(tmp_path: Path,
                                                                      sandbox: ServedSandboxClient) -> None:
    make_task(tmp_path / "tasks" / "quick", "[ -f /app/done ] && echo 1 > /logs/verifier/reward.txt || echo 0 > "
                                  "/logs/verifier/reward.txt\n", toml="[agent]\ntimeout_sec = 0.001\n")
    env = harbor_tasks.load_environment(str(tmp_path / "tasks"), max_turns=5)
    script: list[ScriptEntry] = [tool_call("bash", command="touch done"), tool_call("bash", command="rm done"),
                                 "Done."]
    rollout, server = await sandboxed_rollout(env, env.load_tasks(1)[0], script, sandbox)
    assert len(server.requests_for("agent")) == 1 and rollout.state["stop_reason"] == "stop"
    assert await rewards(env, rollout) == {"verifier": 1.0, "verifier_rewards": 0.0, "verifier_timed_out": 0.0,
                                           "agent_timed_out": 1.0, "num_commands": 1.0}


async def test_a_verifier_without_a_reward_is_an_error_and_one_past_its_timeout_a_zero(
        tmp_path: Path, sandbox: ServedSandboxClient) -> None:
    make_task(tmp_path / "tasks" / "silent", "echo checking; exit 3\n")
    make_task(tmp_path / "tasks" / "garbled", "echo maybe > /logs/verifier/reward.txt\n")
    make_task(tmp_path / "tasks" / "no-reward-key", "echo '{\"accuracy\": 0.5}' > /logs/verifier/reward.json\n")
    make_task(tmp_path / "tasks" / "slow", "sleep 30; echo 1 > /logs/verifier/reward.txt\n",
              toml="[verifier]\ntimeout_sec = 0.5\n")
    tasks = harbor_tasks.read_tasks(tmp_path / "tasks")
    verdicts = {}
    for name, task in tasks.items():
        async with sandbox.session() as box:
            verdicts[name] = dataclasses.asdict(await harbor_tasks.verify(sandbox, box, task))
    assert verdicts["silent"]["exit_code"] == 3 and verdicts["silent"]["output"] == "checking\n"
    with pytest.raises(RewardError, match=r"silent: tests/test.sh wrote no reward file.*checking"):
        harbor_tasks.verifier({"verifier": verdicts["silent"]})
    with pytest.raises(RewardError, match=r"reward.txt holds 'maybe\\n', not a number"):
        harbor_tasks.verifier({"verifier": verdicts["garbled"]})
    with pytest.raises(RewardError, match=r"has no 'reward' \(it has \['accuracy'\]\)"):
        harbor_tasks.verifier({"verifier": verdicts["no-reward-key"]})
    slow = {"verifier": verdicts["slow"]}
    assert (harbor_tasks.verifier(slow), harbor_tasks.verifier_timed_out(slow)) == (0.0, 1.0)
    with pytest.raises(RewardError, match="no verifier verdict"):
        harbor_tasks.verifier({})


def solve(body: dict[str, Any]) -> Any:
    """A scripted agent for both tasks: one command, then done."""
    if body["messages"][-1]["role"] == "tool":
        return "Done."
    asked = body["messages"][1]["content"]
    return tool_call("bash", command="echo Hello > hello.txt" if "hello.txt" in asked else
                     "grep -cx \"$TARGET_WORD\" data/words.txt > count.txt")


async def test_flywheel_eval_runs_the_tasks_and_scores_them(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    server = NatsServer(tmp_path / "nats").start()
    try:
        bus = await Bus.connect(server.url, name="test-harbor-eval")
        try:
            async with backend_named("local", request) as backend, serving(bus, backend) as sandbox:
                with ScriptedOpenAI({"agent": [solve] * 8}) as model:
                    cfg = EvalConfig(env="harbor_tasks", model="agent", base_url=model.base_url,
                                     out=tmp_path / "out.jsonl", num_tasks=2, num_rollouts=2, concurrency=2,
                                     env_args={"path": str(TASKS), "build_images": False})
                    summary = await run_eval(cfg, server.url, io.StringIO())
                records = read_results(cfg.out)
                assert summary["num_errors"] == 0 and summary["num_reward_errors"] == 0, records
                assert summary["pass@1"] == 1.0 and sorted(r["task"]["id"] for r in records) == [
                    "hello-file", "hello-file", "word-count", "word-count"]
                assert all(r["state"]["verifier"]["rewards"]["reward"] == 1.0 for r in records)
                assert not sandbox.manager.sessions
        finally:
            await bus.close()
    finally:
        server.stop()


async def test_a_task_that_needs_its_image_is_refused_by_the_local_backend_naming_docker(
        rows, sandbox: ServedSandboxClient) -> None:
    env = harbor_tasks.load_environment(str(TASKS), max_turns=4)  # build_images: the default
    with pytest.raises(RuntimeError, match=r"task word-count needs the image its environment/Dockerfile builds "
                                           r"\(1 RUN step\): this sandbox service runs the local backend.*"
                                           r"sandbox_backend = \"docker\".*build_images=false"):
        await sandboxed_rollout(env, rows["word-count"], ["Done."], sandbox)
    assert not sandbox.manager.sessions


async def test_no_sandbox_service_fails_the_rollout_with_what_to_do(env, rows) -> None:
    from flywheel.sdk.harness import RolloutContext

    ctx = RolloutContext(task=rows["hello-file"], base_url="http://127.0.0.1:9/v1", api_key="t", model="agent")
    with pytest.raises(SandboxUnavailable, match=r"start the sandbox service \(flywheel up\) or set nats_url"):
        await env.harness.run(env, ctx)


# --- a package of its own -------------------------------------------------------------------


def test_convert_writes_a_package_that_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = harbor_tasks.convert(TASKS, tmp_path / "pkg", owner="acme", name="terminal-tasks")
    project = tomllib.loads((dest / "pyproject.toml").read_text())
    assert project["project"]["name"] == "acme-terminal-tasks"
    assert project["project"]["entry-points"]["flywheel.environments"] == {
        "acme/terminal-tasks": "acme_terminal_tasks:load_environment"}
    assert (dest / "acme_terminal_tasks" / "tasks" / "word-count" / "environment" / "words.txt").is_file()
    assert "not carried over: environment/Dockerfile: 1 RUN instruction not run" in (dest / "README.md").read_text()
    monkeypatch.syspath_prepend(str(dest))
    monkeypatch.delitem(sys.modules, "acme_terminal_tasks", raising=False)
    env = load_environment("acme_terminal_tasks")
    assert env.name == "acme-terminal-tasks" and {r["id"] for r in env.load_tasks(2)} == {"hello-file", "word-count"}
    monkeypatch.delitem(sys.modules, "acme_terminal_tasks")
    # Installed, the package data holds every task file (a wheel built the standard way).
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(tmp_path / "site"), str(dest)], check=True, capture_output=True)
    installed = tmp_path / "site" / "acme_terminal_tasks" / "tasks"
    assert sorted(p.relative_to(installed).as_posix() for p in installed.rglob("*") if p.is_file()) == sorted(
        p.relative_to(TASKS).as_posix() for p in TASKS.rglob("*") if p.is_file())
    entry_points = next((tmp_path / "site").glob("acme_terminal_tasks-0.1.0.dist-info")) / "entry_points.txt"
    assert "acme/terminal-tasks = acme_terminal_tasks:load_environment" in entry_points.read_text()


def test_convert_refuses_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="owner 'Acme'"):
        harbor_tasks.convert(TASKS, tmp_path / "a", owner="Acme", name="x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("")
    with pytest.raises(ValueError, match="not an empty folder"):
        harbor_tasks.convert(TASKS, tmp_path / "full", owner="acme", name="x")
    make_task(tmp_path / "src" / "bad", toml="[verifier]\ntimeout_sec = \"soon\"\n")
    with pytest.raises(EnvironmentLoadError, match=r"\[verifier\] timeout_sec"):
        harbor_tasks.convert(tmp_path / "src", tmp_path / "out", owner="acme", name="x")
    assert not (tmp_path / "out").exists()
    assert read_task(make_task(tmp_path / "src2" / "ok")).id == "ok"
