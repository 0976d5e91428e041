"""The fork server (flywheel.runtime.forkserver) with real processes: a forked service runs its
module as `python -m` would, its exit status and signals reach whoever started it, it dies
with its asker and with the server, and anything the server cannot take is exec'd."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from flywheel.runtime import forkserver
from flywheel.runtime.forkserver import Forked, ForkServer, launch
from tests.helpers import until

ROOT = Path(__file__).resolve().parents[2]
# Small modules at both levels, so the test does not pay for torch: the child reports whether
# the base level's module was there before it ran.
MODULES = (("xml.dom.minidom",), ("json",))


def env_of(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture
def server(tmp_path: Path):
    fork = ForkServer(tmp_path, env_of(), tmp_path / "fork-server.log", MODULES)
    assert fork.usable
    fork.start()
    yield fork
    fork.stop()


def report(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_a_forked_service_runs_its_module_with_its_own_argv_env_session_and_log(server: ForkServer,
                                                                                     tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = await launch(["-m", "tests.forked_child", "3"], env_of(FORKED_CHILD_MARKER="m1"), log,
                         (tmp_path, "base"))
    assert isinstance(child, Forked)
    assert await asyncio.to_thread(child.wait, 20) == 3
    seen = report(log)
    assert seen == {"argv": ["3"], "marker": "m1", "cwd": os.getcwd(), "pid": child.pid, "sid": child.pid,
                    "main": "__main__", "preloaded": True}
    assert child.poll() == 3


async def test_signals_reach_a_forked_service_and_its_status_says_so(server: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = await launch(["-m", "tests.forked_child", "sleep"], env_of(), log, (tmp_path, "torch"))
    assert isinstance(child, Forked)
    await until(lambda: log.exists() and log.read_text() != "", what="the child's first line")
    assert "tests.forked_child sleep" in " ".join(psutil.Process(child.pid).cmdline())  # its own title in ps
    os.killpg(child.pid, signal.SIGTERM)
    assert await asyncio.to_thread(child.wait, 20) == -signal.SIGTERM


def test_a_forked_service_dies_with_whoever_asked_for_it(server: ForkServer, tmp_path: Path) -> None:
    log, folder = str(tmp_path / "c.log"), str(tmp_path)
    asker = textwrap.dedent(f"""
        import asyncio, pathlib, sys, time
        from flywheel.runtime.forkserver import launch
        async def main():
            child = await launch(["-m", "tests.forked_child", "sleep"], {env_of()!r}, pathlib.Path({log!r}),
                                 (pathlib.Path({folder!r}), "base"))
            print(child.pid, type(child).__name__, flush=True)
            await asyncio.sleep(600)  # noqa: sleep - an asker that lives until the test kills it
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", asker], stdout=subprocess.PIPE, text=True, env=env_of())
    try:
        assert proc.stdout is not None
        pid, kind = proc.stdout.readline().split()
        assert kind == "Forked" and alive(int(pid))
        proc.kill()
        proc.wait()
        asyncio.run(until(lambda: not alive(int(pid)), 20, "the child to die with its asker"))
    finally:
        proc.kill()


async def test_a_forked_service_dies_with_the_server_and_its_asker_learns_it(server: ForkServer,
                                                                            tmp_path: Path) -> None:
    child = await launch(["-m", "tests.forked_child", "sleep"], env_of(), tmp_path / "c.log", (tmp_path, "base"))
    assert isinstance(child, Forked)
    assert server.process is not None
    server.process.kill()
    assert await asyncio.to_thread(child.wait, 20) == -signal.SIGTERM
    assert not alive(child.pid)


async def test_what_the_server_cannot_take_is_execd(server: ForkServer, tmp_path: Path) -> None:
    other_path = env_of(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")  # another PYTHONPATH: refused
    child = await launch(["-m", "tests.forked_child", "4"], other_path, tmp_path / "a.log", (tmp_path, "base"))
    assert isinstance(child, subprocess.Popen)
    assert await asyncio.to_thread(child.wait, 20) == 4
    assert report(tmp_path / "a.log")["preloaded"] is False
    # No server for this folder (a deployment): exec'd.
    elsewhere = tmp_path / "elsewhere"
    child = await launch(["-m", "tests.forked_child", "5"], env_of(), tmp_path / "b.log", (elsewhere, "base"))
    assert isinstance(child, subprocess.Popen) and await asyncio.to_thread(child.wait, 20) == 5


async def test_a_socket_left_by_a_killed_stack_is_passed_over(tmp_path: Path) -> None:
    fork = ForkServer(tmp_path, env_of(), tmp_path / "fork-server.log", MODULES)
    fork.start()
    assert fork.process is not None
    fork.process.kill()  # as a SIGKILL of the stack leaves it: the socket files stay
    fork.process.wait()
    assert forkserver.socket_path(tmp_path, "base").exists()
    child = await launch(["-m", "tests.forked_child", "0"], env_of(), tmp_path / "c.log", (tmp_path, "base"))
    assert isinstance(child, subprocess.Popen) and await asyncio.to_thread(child.wait, 20) == 0


async def test_a_machine_with_a_gpu_has_no_torch_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = tmp_path / "nvidiactl"
    device.touch()
    monkeypatch.setattr(forkserver, "ACCELERATOR_DEVICES", (str(device),))
    fork = ForkServer(tmp_path, env_of(), tmp_path / "fork-server.log", MODULES)
    fork.start()
    try:
        assert not forkserver.socket_path(tmp_path, "torch").exists()
        child = await launch(["-m", "tests.forked_child", "0"], env_of(), tmp_path / "t.log", (tmp_path, "torch"))
        assert isinstance(child, subprocess.Popen) and await asyncio.to_thread(child.wait, 20) == 0
        child = await launch(["-m", "tests.forked_child", "0"], env_of(), tmp_path / "b.log", (tmp_path, "base"))
        assert isinstance(child, Forked) and await asyncio.to_thread(child.wait, 20) == 0
    finally:
        fork.stop()
