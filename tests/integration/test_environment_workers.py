"""Environment workers' lifecycle, with real sandboxed worker processes (bubblewrap): a worker
is started on first use and reused per environment version and tenant, more are started when
the busy ones hold ``max_calls`` calls (up to ``max_per_environment``), idle ones stop, one that
dies or whose event loop hangs fails only the calls it held, each with an error naming it, and
the next call starts another. tests/envs/lifecycle_env.py misbehaves as each task says. A
rollout of a plain chat harness runs in its host, from the first messages its worker gave,
exactly as it would in the worker; any other harness runs in the worker."""

from __future__ import annotations

import asyncio
import json
import sysconfig
import time
from pathlib import Path

import msgspec
import pytest

from flywheel.contract.settings import WorkersSettings
from flywheel.runtime import environments
from flywheel.runtime.environments import (
    HostedChat,
    RolloutLink,
    WorkerEnvironment,
    WorkerError,
    WorkerPool,
    WorkerRollout,
    worker_layout,
)
from flywheel.runtime.envworker import LoadSpec
from flywheel.runtime.isolation import View, bwrap_argv
from flywheel.sdk.environment import EnvironmentLoadError
from tests.helpers import until, worker_pool
from tests.integration.conftest import ENVS
from tests.unit.test_store import rollout

SPEC = LoadSpec.of("lifecycle_env")


@pytest.fixture(autouse=True)
def envs_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))


async def behave(env: WorkerEnvironment, *tasks: str) -> list[float | None]:
    """Each task's ``behave`` score (one rollout each, scored together in one call)."""
    rollouts = [msgspec.structs.replace(rollout(f"r-{i}-{what}"), task_data={"do": what})
                for i, what in enumerate(tasks)]
    outcomes = await env.score(rollouts, ["behave"], timeout_s=120)
    return [row[0].value for row in outcomes]


def pids(pool: WorkerPool, tenant: str | None = None) -> list[int]:
    return [w["pid"] for w in pool.info() if tenant is None or w["tenant"] == tenant]


async def test_one_worker_per_environment_and_tenant_and_a_crash_fails_only_its_own_call() -> None:
    async with worker_pool("scorer") as pool:
        mine = await pool.load(SPEC, "a")
        assert await behave(mine, "nothing") == [1.0]
        again = await pool.load(SPEC, "a")  # the same version and tenant: the same worker
        assert await behave(again, "nothing") == [1.0]
        theirs = await pool.load(SPEC, "b")  # another tenant's: a worker of its own
        assert await behave(theirs, "nothing") == [1.0]
        assert len(pids(pool, "a")) == 1 and len(pids(pool, "b")) == 1
        assert {(w["environment"], w["tenant"]) for w in pool.info()} == {("lifecycle_env", "a"),
                                                                          ("lifecycle_env", "b")}
        first, other = pids(pool, "a")[0], pids(pool, "b")[0]

        with pytest.raises(WorkerError) as crashed:
            await behave(mine, "crash")
        # The error names the worker and how it ended: what the rollout's score says.
        assert "environment worker of lifecycle_env (tenant a)" in str(crashed.value), crashed.value
        assert "exit status 3" in str(crashed.value), crashed.value
        assert pids(pool, "b") == [other]  # the other tenant's worker is untouched
        assert await behave(theirs, "nothing") == [1.0]
        assert await behave(mine, "nothing") == [1.0]  # the next call starts another
        assert pids(pool, "a") != [first] and len(pids(pool, "a")) == 1


async def test_a_worker_whose_loop_hangs_is_killed_and_the_next_call_gets_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environments, "PING_EVERY_S", 0.5)
    async with worker_pool("scorer", unresponsive_s=2.0) as pool:
        env = await pool.load(SPEC, "a")
        assert await behave(env, "nothing") == [1.0]
        hung = pids(pool)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"did not answer for 2s \(its environment's code held its event loop\)"):
            await behave(env, "hang")
        assert time.monotonic() - started < 30  # not the minute it would hold
        assert await behave(env, "nothing") == [1.0]
        assert pids(pool) != hung


async def test_busy_workers_scale_out_to_the_limit_and_idle_ones_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environments, "PING_EVERY_S", 0.5)
    async with worker_pool("scorer", max_calls=1, max_per_environment=2, idle_s=2.0) as pool:
        env = await pool.load(SPEC, "a")
        assert await behave(env, "nothing") == [1.0]
        # Three slow calls at once: a second worker, not a third; each call is answered.
        results = await asyncio.gather(*(behave(env, "slow") for _ in range(3)))
        assert results == [[1.0]] * 3
        assert len(pids(pool)) == 2
        await until(lambda: not pool.info(), timeout_s=30, what="the idle workers to stop")


async def test_an_environment_that_does_not_load_says_so_and_the_pool_goes_on() -> None:
    async with worker_pool("scorer") as pool:
        with pytest.raises(EnvironmentLoadError, match="no_such_environment"):
            await pool.load(LoadSpec.of("no_such_environment"), "a")
        env = await pool.load(SPEC, "a")
        assert await behave(env, "nothing") == [1.0]


def test_without_a_fresh_proc_a_sandbox_gets_none_of_the_hosts() -> None:
    view = View(read_only=(), hidden=(), binds=(), disk_mb=8)
    full = bwrap_argv("bwrap", view, {}, ["true"], has_size=True, has_disable_userns=False)
    assert full[full.index("--proc") + 1] == "/proc"
    bare = bwrap_argv("bwrap", view, {}, ["true"], has_size=True, has_disable_userns=False, has_proc=False)
    assert "--proc" not in bare and not any(a == "/proc" for a in bare)


def test_a_workers_view_has_its_packages_never_the_root_the_working_folder_or_the_data_dir(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend("/")  # a script run from / puts / on the path
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m` does: the working folder, not named in PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", str(ENVS))
    vendored = Path(sysconfig.get_path("purelib")) / "setuptools" / "_vendor"
    if vendored.is_dir():  # what importing setuptools adds to a process's path
        monkeypatch.syspath_prepend(str(vendored))
    data = tmp_path / "data"
    layout = worker_layout(WorkersSettings(), [data])
    assert str(vendored) not in layout.path  # its old copies would shadow the site folder's packages
    assert "/" not in layout.view.read_only and str(tmp_path) not in layout.view.read_only
    assert str(ENVS) in layout.view.read_only and str(ENVS) in layout.path
    assert sysconfig.get_path("purelib") in layout.view.read_only
    assert layout.view.hidden == (str(data),)


async def test_a_plain_chat_runs_in_its_host_as_in_its_worker_and_any_other_harness_in_the_worker() -> None:
    answer = json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "cba"}}]}).encode()
    asked: list[bytes] = []

    async def post(url: str, body: bytes) -> tuple[int, bytes]:
        asked.append(body)
        return 200, answer

    async with worker_pool("inference") as pool:
        env = await pool.load(LoadSpec.of("reverse_text"), "a")
        assert env.info.plain_chat_turns == 1  # the platform's ChatHarness, a system prompt, nothing else
        task = {"text": "abc"}
        first = await env.prompt_messages(task)
        hosted = await env.start_rollout(RolloutLink("r-1", "run", "http://model/v1", "k", post=post), first)
        in_worker = await env.start_rollout(RolloutLink("r-2", "run", "http://model/v1", "k", post=post))
        assert isinstance(hosted, HostedChat) and isinstance(in_worker, WorkerRollout)
        calls = sum(w["calls"] for w in pool.info())
        here = await hosted.run(task, model="m", index=0, timeout_s=30)
        assert sum(w["calls"] for w in pool.info()) == calls  # no round trip to the worker
        there = await in_worker.run(task, model="m", index=1, timeout_s=30)
        assert here.error is None and there.error is None
        assert here.state == there.state == {"turns": 1, "stop_reason": "done"}
        assert asked[0] == asked[1]  # the same request, the system prompt first
        assert json.loads(asked[0])["messages"][0] == {"role": "system", "content": "Reverse the text."}

        asking = asyncio.Event()

        async def never(url: str, body: bytes) -> tuple[int, bytes]:  # the model never answers
            asking.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        stopped = await env.start_rollout(RolloutLink("r-3", "run", "http://model/v1", "k", post=never), first)
        running = asyncio.ensure_future(stopped.run(task, model="m", index=2, timeout_s=30))
        await asyncio.wait_for(asking.wait(), 30)  # under way: waiting on its model
        stopped.stop("the run ended")
        assert (await running).error == "stopped: the run ended"

        flaky = await pool.load(LoadSpec.of("flaky_env"), "a")  # a harness of its own: always in its worker
        assert flaky.info.plain_chat_turns is None
        own = await flaky.start_rollout(RolloutLink("r-4", "run", "http://model/v1", "k", post=post),
                                        await flaky.prompt_messages({"text": "ab", "fail": False}))
        assert isinstance(own, WorkerRollout)


async def test_environment_code_reaches_the_endpoints_its_run_config_names_and_nothing_else(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A user simulator's model, a judge: a worker has no network, so its host makes the call, to an
    URL an argument of the environment gives (or under its path) and to nothing else."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\npong")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    named, other = f"http://127.0.0.1:{port}/judge", f"http://127.0.0.1:{port}/admin"
    try:
        async with worker_pool("scorer") as pool:
            env = await pool.load(LoadSpec(env_id="lifecycle_env", args={"judge_url": named}), "a")
            rollouts = [msgspec.structs.replace(rollout(f"r-{i}"), task_data={"do": "ask", "url": url})
                        for i, url in enumerate([named + "/v1/ping", other, f"{named}/../admin"])]
            outcomes = await env.score(rollouts, ["behave"], timeout_s=60)
            assert outcomes[0][0].value == 1.0, outcomes[0][0]
            for (outcome,) in outcomes[1:]:  # httpx makes .../judge/../admin .../admin before it goes
                assert outcome.error is not None and "is not an endpoint this environment's run config names" in \
                    outcome.error and f"{other}'" in outcome.error, outcome
            # An answer past the bound is refused, not read on into the host's memory.
            monkeypatch.setattr(environments, "EGRESS_MAX_BYTES", 3)
            (row,) = await env.score(rollouts[:1], ["behave"], timeout_s=60)
            assert row[0].error is not None and "answered more than 3 bytes" in row[0].error, row[0]
            # Another tenant's worker of the same environment, loaded without the argument, reaches nothing.
            bare = await pool.load(LoadSpec(env_id="lifecycle_env"), "b")
            (row,) = await bare.score(rollouts[:1], ["behave"], timeout_s=60)
            assert row[0].error is not None and "no URL" in row[0].error, row[0]
    finally:
        server.close()
        await server.wait_closed()
