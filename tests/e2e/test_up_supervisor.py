"""The embedded-stack supervisor with small stand-in services (a few lines of Python each).

Start order, shared environment, refusal on a service that dies or stays unhealthy,
restarts with a bounded budget, SIGKILL after the stop timeout, and the embedded
nats-server. Runs the :class:`Stack` in this process against a real nats-server; the whole
``flywheel up`` with the real gateway is tests/e2e/test_up.py.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
from pathlib import Path

import pytest

from flywheel.natsserver import NatsServer, free_port, port_open
from flywheel.settings import Settings
from flywheel.stack import Process, ServiceSpec, Stack, StackError
from tests.helpers import until


async def healthy(stack: Stack, process: Process) -> str | None:
    return None


async def never_healthy(stack: Stack, process: Process) -> str | None:
    return "no heartbeat yet"


def says(text: str):
    """Healthy once the current start of the process printed the line ``text``."""

    async def check(stack: Stack, process: Process) -> str | None:
        with process.log_path.open("rb") as f:
            f.seek(process.log_offset)
            return None if f"\n{text}\n" in f.read().decode() else f"has not printed {text!r}"

    return check


def python(code: str, health=healthy) -> ServiceSpec:
    return ServiceSpec(("-c", code), health)


SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"  # noqa: sleep - a stand-in service process that just stays up until stopped


def settings(tmp_path: Path, nats_url: str | None) -> Settings:
    return Settings(data_dir=tmp_path / "data", nats_url=nats_url, nats_port=free_port(), gateway_port=free_port())


def started_pids(out: io.StringIO, name: str) -> list[int]:
    return [int(pid) for pid in re.findall(rf"^started {name} \(pid (\d+)\)", out.getvalue(), re.M)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def start(stack: Stack, out: io.StringIO) -> asyncio.Task[None]:
    running = asyncio.ensure_future(stack.run())
    await until(lambda: "Flywheel is up" in out.getvalue() or running.done(), timeout_s=30, what="the stack")
    if running.done():
        running.result()  # raises what stopped it
    return running


async def test_services_start_in_order_share_settings_and_stop_in_reverse(tmp_path: Path,
                                                                          nats_server: NatsServer) -> None:
    show_env = ("import os, time; print(os.environ['FLYWHEEL_NATS_URL'], os.environ['FLYWHEEL_DATA_DIR'], "
                "os.environ['FLYWHEEL_DATABASE_URL'], flush=True); time.sleep(120)")  # noqa: sleep - the stand-in service prints its settings, then stays up until stopped
    out = io.StringIO()
    cfg = settings(tmp_path, nats_server.url)
    stack = Stack(cfg, out, services={"first": python(show_env), "second": python(SLEEPER, says("ready"))})
    running = await start(stack, out)
    data_dir = (tmp_path / "data").resolve()
    assert f"  NATS      {nats_server.url} (existing server)" in out.getvalue()
    assert f"  logs      {data_dir / 'logs'}" in out.getvalue()
    stack.stopping.set()  # what SIGINT or SIGTERM does
    await running
    text = out.getvalue()
    order = [text.index(s) for s in ("started first", "first is healthy", "started second", "second is healthy",
                                      "Flywheel is up", "stopping: second, first", "stopped second", "stopped first")]
    assert order == sorted(order)
    assert all(p.returncode() is not None for p in stack.services)
    line = (data_dir / "logs" / "first.log").read_text().splitlines()[-1]
    assert line == f"{nats_server.url} {data_dir} sqlite+aiosqlite:///{data_dir / 'flywheel.db'}"


async def test_a_service_that_dies_at_start_stops_the_stack_with_its_log(tmp_path: Path,
                                                                         nats_server: NatsServer) -> None:
    out = io.StringIO()
    dies = "import sys; print('boom: no such model', flush=True); sys.exit(3)"
    stack = Stack(settings(tmp_path, nats_server.url), out,
                  services={"steady": python(SLEEPER), "broken": python(dies, never_healthy)})
    with pytest.raises(StackError) as err:
        await stack.run()
    message = str(err.value)
    assert message.startswith("broken exited with code 3 during start-up; last lines of ")
    assert "  | boom: no such model" in message
    assert "stopping: broken, steady" in out.getvalue()
    assert not any(alive(pid) for pid in started_pids(out, "steady") + started_pids(out, "broken"))


async def test_an_unhealthy_service_times_out_with_the_reason(tmp_path: Path, nats_server: NatsServer) -> None:
    out = io.StringIO()
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"mute": python(SLEEPER, never_healthy)},
                  start_timeout_s=0.5)
    with pytest.raises(StackError, match=r"mute \(pid \d+\) is not healthy after 0.5s \(no heartbeat yet\); "
                                         r"last lines of .*mute.log:\n  \| --- flywheel up: .*\n  \| ready"):
        await stack.run()
    assert not any(alive(pid) for pid in started_pids(out, "mute"))


async def test_a_crashed_service_is_restarted(tmp_path: Path, nats_server: NatsServer) -> None:
    out = io.StringIO()
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"worker": python(SLEEPER, says("ready"))},
                  restart_backoff_s=0.05)
    running = await start(stack, out)
    [first] = started_pids(out, "worker")
    os.kill(first, 9)
    await until(lambda: len(started_pids(out, "worker")) == 2 and out.getvalue().count("worker is healthy") == 2,
                what="the restarted worker")
    assert "worker (pid %d) exited unexpectedly with signal SIGKILL; restarting in 0.05s (restart 1 of at most 5" \
           % first in out.getvalue()
    stack.stopping.set()
    await running
    assert not any(alive(pid) for pid in started_pids(out, "worker"))


async def test_a_service_that_keeps_crashing_ends_the_stack(tmp_path: Path, nats_server: NatsServer) -> None:
    out = io.StringIO()
    crashes = "import time; print('up', flush=True); time.sleep(0.3); print('lost the database'); raise SystemExit(2)"
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"flaky": python(crashes)},
                  max_restarts=2, restart_backoff_s=0.05)
    with pytest.raises(StackError) as err:
        await stack.run()
    assert str(err.value).startswith("flaky exited with code 2; it was restarted 2 times within 600s, giving up; ")
    assert "  | lost the database" in str(err.value)
    assert "(restart 2 of at most 2 within 600s)" in out.getvalue()
    pids = started_pids(out, "flaky")
    assert len(pids) == 3 and not any(alive(pid) for pid in pids)


async def test_a_service_that_ignores_sigterm_is_killed(tmp_path: Path, nats_server: NatsServer) -> None:
    out = io.StringIO()
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(120)")
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"stubborn": python(stubborn, says("ready"))},
                  stop_timeout_s=0.3)
    running = await start(stack, out)
    stack.stopping.set()
    await running
    [process] = stack.services
    assert process.returncode() == -9


async def test_embedded_nats_server_is_started_and_stopped(tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = settings(tmp_path, None)
    stack = Stack(cfg, out, services={})
    running = await start(stack, out)
    [pid] = started_pids(out, "nats-server")
    assert port_open("127.0.0.1", cfg.nats_port) and alive(pid)
    assert f"  NATS      nats://127.0.0.1:{cfg.nats_port} (pid {pid})" in out.getvalue()
    assert (tmp_path / "data" / "nats" / "jetstream").is_dir()
    assert "Server is ready" in (tmp_path / "data" / "logs" / "nats-server.log").read_text()
    stack.stopping.set()
    await running
    assert not alive(pid) and not port_open("127.0.0.1", cfg.nats_port)
