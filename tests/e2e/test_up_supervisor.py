"""The embedded-stack supervisor with small stand-in services (a few lines of Python each).

Start order, shared environment, refusal on a service that dies or stays unhealthy at
start-up, restarts that never give up (at once after a healthy stretch, with a growing and
capped backoff in a crash loop) while the rest keeps serving, the supervisor's view in
``flywheel status``, SIGKILL after the stop timeout, and the embedded nats-server. Runs the
:class:`Stack` in this process against a real nats-server; the whole ``flywheel up`` with
the real gateway is tests/e2e/test_up.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from flywheel.contract.bus import Bus
from flywheel.contract.service import read_heartbeats
from flywheel.contract.settings import Settings
from flywheel.ops import cli
from flywheel.ops.stack import STACK_SERVICE, Stack, StackError
from flywheel.runtime.natsserver import NatsServer, free_port, port_open
from flywheel.runtime.supervise import Process, ServiceSpec, Supervisor
from tests.helpers import until


async def healthy(stack: Supervisor, process: Process) -> str | None:
    return None


async def never_healthy(stack: Supervisor, process: Process) -> str | None:
    return "no heartbeat yet"


def says(text: str):
    """Healthy once the current start of the process printed the line ``text``."""

    async def check(stack: Supervisor, process: Process) -> str | None:
        with process.log_path.open("rb") as f:
            f.seek(process.log_offset)
            return None if f"\n{text}\n" in f.read().decode() else f"has not printed {text!r}"

    return check


def python(code: str, health=healthy) -> ServiceSpec:
    return ServiceSpec(("-c", code), health)


# A deliberate sleep: a stand-in service process that just stays up until stopped.
SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"  # noqa: sleep


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


def restart_delays(out: io.StringIO, name: str) -> list[float]:
    """The waits the stack announced before each restart of ``name``, in order."""
    return [float(s) for s in re.findall(rf"^{name} \(pid \d+\) .*; restarting in ([\d.]+)s", out.getvalue(), re.M)]


async def status_json(capsys: pytest.CaptureFixture[str], nats_url: str) -> dict[str, Any]:
    """``flywheel status --json``, run in a thread (it runs its own event loop) as a user would."""
    no_gateway = f"http://127.0.0.1:{free_port()}"
    code = await asyncio.to_thread(cli.main, ["status", "--json", "--nats-url", nats_url, "--gateway-url", no_gateway])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def processes_of(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The processes of the one stack in a status report, by name."""
    [stack] = report["stacks"]
    return {p["name"]: p for p in stack["processes"]}


async def start(stack: Stack, out: io.StringIO) -> asyncio.Task[None]:
    running = asyncio.ensure_future(stack.run())
    await until(lambda: "Flywheel is up" in out.getvalue() or running.done(), timeout_s=30, what="the stack")
    if running.done():
        running.result()  # raises what stopped it
    return running


async def test_services_start_in_order_share_settings_and_stop_in_reverse(tmp_path: Path, nats_server: NatsServer,
                                                                          bus: Bus) -> None:
    show_env = ("import os, time; print(os.environ['FLYWHEEL_NATS_URL'], os.environ['FLYWHEEL_DATA_DIR'], "
                # A deliberate sleep: the stand-in service prints its settings, then stays up until stopped.
                "os.environ['FLYWHEEL_DATABASE_URL'], flush=True); time.sleep(120)")  # noqa: sleep
    out = io.StringIO()
    cfg = settings(tmp_path, nats_server.url)
    stack = Stack(cfg, out, services={"first": python(show_env), "second": python(SLEEPER, says("ready"))})
    running = await start(stack, out)
    data_dir = (tmp_path / "data").resolve()
    assert f"  NATS      {nats_server.url} (existing server)" in out.getvalue()
    assert f"  logs      {data_dir / 'logs'}" in out.getvalue()
    [beat] = [b for b in await read_heartbeats(bus) if b.service == STACK_SERVICE]
    assert beat.pid == os.getpid()
    assert [(p["name"], p["state"]) for p in beat.info["processes"]] == [("first", "running"), ("second", "running")]
    stack.stopping.set()  # what SIGINT or SIGTERM does
    await running
    assert not any(b.service == STACK_SERVICE for b in await read_heartbeats(bus))  # removed before the bus closed
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
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"worker": python(SLEEPER, says("ready"))})
    running = await start(stack, out)
    [first] = started_pids(out, "worker")
    os.kill(first, 9)
    await until(lambda: len(started_pids(out, "worker")) == 2 and out.getvalue().count("worker is healthy") == 2,
                what="the restarted worker")
    assert f"worker (pid {first}) exited unexpectedly with signal SIGKILL after " in out.getvalue()
    assert "s healthy; restarting in 0s (restart 1); last lines of " in out.getvalue()
    stack.stopping.set()
    await running
    assert not any(alive(pid) for pid in started_pids(out, "worker"))


async def test_a_service_that_keeps_crashing_backs_off_while_the_rest_keeps_serving(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    # A deliberate sleep: the stand-in crashes a moment after it starts, each time.
    crashes = ("import time; print('up', flush=True); time.sleep(0.3); "  # noqa: sleep
               "print('lost the database', flush=True); raise SystemExit(2)")
    cfg = settings(tmp_path, None)  # the stack's own nats-server, which must outlive the crash loop
    stack = Stack(cfg, out, services={"steady": python(SLEEPER, says("ready")), "flaky": python(crashes)},
                  restart_backoff_s=0.1, max_backoff_s=0.4)
    running = await start(stack, out)
    await until(lambda: restart_delays(out, "flaky").count(0.4) >= 3 or running.done(), timeout_s=60,
                what="flaky to reach the cap")
    assert not running.done(), out.getvalue()  # the stack did not give up
    assert restart_delays(out, "flaky")[:6] == [0, 0.1, 0.2, 0.4, 0.4, 0.4]  # doubles, then capped
    assert "flaky (pid " in out.getvalue() and "exited unexpectedly with code 2 after " in out.getvalue()
    assert "(restart 4; exit 4 in a row, each before 30s healthy: the wait doubles, up to 0.4s); last lines of " \
           in out.getvalue() and "  | lost the database" in out.getvalue()
    [nats_pid], [steady_pid] = started_pids(out, "nats-server"), started_pids(out, "steady")
    assert not running.done() and alive(nats_pid) and alive(steady_pid)

    report: dict[str, Any] = {}

    async def reported_backing_off() -> bool:
        report.update(await status_json(capsys, cfg.resolved_nats_url))
        return processes_of(report)["flaky"]["state"] == "backing off"

    await until(reported_backing_off, timeout_s=30, what="status to show flaky backing off")
    processes = processes_of(report)
    assert [(name, p["pid"], p["state"], p["num_restarts"]) for name, p in processes.items() if name != "flaky"] == [
        ("nats-server", nats_pid, "running", 0), ("steady", steady_pid, "running", 0)]
    flaky = processes["flaky"]
    assert flaky["num_restarts"] >= 5 and flaky["num_failures"] == flaky["num_restarts"] + 1
    assert flaky["last_exit"] == "code 2" and flaky["backoff_s"] == 0.4 and 0 <= flaky["next_start_in_s"] <= 0.4
    assert flaky["pid"] in started_pids(out, "flaky") and flaky["log"] == str(stack.log_dir / "flaky.log")
    assert report["stacks"][0]["failing"] == ["flaky"] and report["stacks"][0]["pid"] == os.getpid()
    assert STACK_SERVICE not in {s["service"] for s in report["services"]}
    assert not running.done() and alive(nats_pid) and alive(steady_pid)

    stack.stopping.set()
    await running
    assert not any(alive(pid) for pid in [nats_pid, steady_pid, *started_pids(out, "flaky")])


async def test_a_service_killed_after_a_healthy_stretch_is_restarted_at_once(
        tmp_path: Path, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]) -> None:
    counter = tmp_path / "starts"
    # Starts 2 to 4 crash at once (a crash loop that grows the backoff); the others run fine.
    worker = (f"import pathlib, sys, time; c = pathlib.Path({str(counter)!r}); "
              "n = int(c.read_text()) + 1 if c.exists() else 1; c.write_text(str(n)); "
              "sys.exit(f'start {n}: lost the database') if 2 <= n <= 4 else print('ready', flush=True); "
              "time.sleep(120)")  # noqa: sleep - the stand-in service stays up until stopped
    out = io.StringIO()
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"worker": python(worker, says("ready"))},
                  restart_backoff_s=0.1, max_backoff_s=10.0, healthy_after_s=1.0)
    [process] = stack.services
    running = await start(stack, out)
    os.kill(started_pids(out, "worker")[0], 9)
    await until(lambda: out.getvalue().count("worker is healthy") == 2, timeout_s=30, what="the crash loop to end")
    assert restart_delays(out, "worker") == [0, 0.1, 0.2, 0.4]
    await until(lambda: time.monotonic() - process.healthy_at > 1.0,  # type: ignore[operator]  # healthy: awaited above
                what="a healthy stretch")

    os.kill(started_pids(out, "worker")[-1], 9)
    # Restarted within about a second (the stack looks every 0.25s), not after the grown backoff.
    await until(lambda: len(started_pids(out, "worker")) == 6, timeout_s=2.0, what="the worker started again")
    assert restart_delays(out, "worker")[-1] == 0
    await until(lambda: out.getvalue().count("worker is healthy") == 3, what="the restarted worker")
    worker_view = processes_of(await status_json(capsys, nats_server.url))["worker"]
    assert (worker_view["state"], worker_view["num_restarts"], worker_view["num_failures"], worker_view["backoff_s"],
            worker_view["last_exit"], worker_view["pid"]) == ("running", 5, 1, 0, "signal SIGKILL",
                                                                started_pids(out, "worker")[-1])
    stack.stopping.set()
    await running


async def test_a_restart_that_stays_unhealthy_is_stopped_and_tried_again(
        tmp_path: Path, nats_server: NatsServer) -> None:
    marker = tmp_path / "started-once"
    # Healthy (prints ready) only on its first start; later starts hang without a word.
    worker = (f"import pathlib, time; m = pathlib.Path({str(marker)!r}); first = not m.exists(); m.touch(); "
              # A deliberate sleep: the stand-in service stays up until stopped.
              "print('ready' if first else 'stuck', flush=True); time.sleep(120)")  # noqa: sleep
    out = io.StringIO()
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"worker": python(worker, says("ready"))},
                  start_timeout_s=0.5, restart_backoff_s=0.1, stop_timeout_s=2.0)
    running = await start(stack, out)
    os.kill(started_pids(out, "worker")[0], 9)
    await until(lambda: len(restart_delays(out, "worker")) >= 3 or running.done(), timeout_s=30,
                what="two restarts that stay unhealthy")
    assert not running.done(), out.getvalue()
    assert re.search(r"^worker \(pid \d+\) was stopped, not healthy after 0.5s \(has not printed 'ready'\); "
                     r"restarting in 0.1s", out.getvalue(), re.M), out.getvalue()
    assert stack.services[0].last_exit == "not healthy" and not running.done()
    stack.stopping.set()
    await running
    assert not any(alive(pid) for pid in started_pids(out, "worker"))


async def test_a_running_service_that_stops_being_healthy_is_stopped_and_started_again(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """Alive but useless (a blocked event loop renews no heartbeat): found by its health check while
    it runs, not only by its exit."""
    marker = tmp_path / "started-once"
    # Its first start says it is stuck a moment after it is ready; later starts stay ready.
    # A deliberate sleep: healthy a moment (0.5 s), then stuck, then up until stopped.
    worker = (f"import pathlib, time; m = pathlib.Path({str(marker)!r}); first = not m.exists(); m.touch(); "
              "print('ready', flush=True); time.sleep(0.5); "  # noqa: sleep - ready a moment before it is stuck
              "print('stuck' if first else 'fine', flush=True); "
              "time.sleep(120)")  # noqa: sleep - the stand-in service stays up until stopped

    async def until_stuck(stack: Supervisor, process: Process) -> str | None:
        with process.log_path.open("rb") as f:
            f.seek(process.log_offset)
            text = f.read().decode()
        return "its loop is stuck" if "\nstuck\n" in text else None if "\nready\n" in text else "not ready"

    out = io.StringIO()
    stack = Stack(settings(tmp_path, nats_server.url), out, services={"worker": python(worker, until_stuck)},
                  restart_backoff_s=0.1, stop_timeout_s=2.0, health_every_s=0.1, unhealthy_after_s=0.5)
    running = await start(stack, out)
    first = started_pids(out, "worker")[0]
    await until(lambda: len(started_pids(out, "worker")) == 2, timeout_s=15, what="the stuck worker started again")
    assert re.search(rf"^worker \(pid {first}\) is not healthy: its loop is stuck; stopping it$", out.getvalue(), re.M)
    assert re.search(rf"^worker \(pid {first}\) was stopped: its loop is stuck for 0.5s while it ran", out.getvalue(),
                     re.M), out.getvalue()
    assert not alive(first) and stack.services[0].last_exit == "not healthy"
    await asyncio.sleep(1.5)  # noqa: sleep - the second start stays healthy: no further restart
    assert len(started_pids(out, "worker")) == 2
    stack.stopping.set()
    await running


async def test_a_service_that_ignores_sigterm_is_killed(tmp_path: Path, nats_server: NatsServer) -> None:
    out = io.StringIO()
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(120)")  # noqa: sleep - a stand-in that ignores SIGTERM and stays up until killed
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
    assert f"  NATS      nats://operator:***@127.0.0.1:{cfg.nats_port} (pid {pid})" in out.getvalue()
    assert (tmp_path / "data" / "nats" / "jetstream").is_dir()
    assert "Server is ready" in (tmp_path / "data" / "logs" / "nats-server.log").read_text()
    stack.stopping.set()
    await running
    assert not alive(pid) and not port_open("127.0.0.1", cfg.nats_port)


@contextlib.contextmanager
def small_disk(folder: Path, size_mib: int) -> Iterator[Path]:
    """A file system of ``size_mib`` at ``folder`` (a tmpfs: mounting one needs root), unmounted after."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(folder)],
                             check=False, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full disk needs a small file system, and this test cannot mount one here "
                    f"({mounted.stderr.strip() or 'mount failed'}; it needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until its file system has no space left."""
    with path.open("wb") as out:
        chunk = b"\0" * 2**20
        with contextlib.suppress(OSError):
            while True:
                out.write(chunk)
                out.flush()


async def test_a_store_that_failed_on_a_full_disk_recovers_once_space_is_freed(tmp_path: Path) -> None:
    """A full disk: a stream whose store failed a write takes nothing more, even once space is
    back, while JetStream still answers. The stack says "disk full" and waits (a restart does not
    cure that), then restarts nats-server as soon as space is freed: the stream takes messages
    again and keeps those it had."""
    with small_disk(tmp_path / "disk", 96) as disk:
        out = io.StringIO()
        cfg = Settings(data_dir=disk / "data", nats_port=free_port(), gateway_port=free_port())
        stack = Stack(cfg, out, services={}, health_every_s=0.2, restart_backoff_s=0.1)
        running = await start(stack, out)
        [first] = started_pids(out, "nats-server")
        bus = await Bus.connect(stack.nats_url, name="test")
        try:
            for i in range(3):
                await bus.js.publish("tasks.r.e", b"kept %d" % i)
            fill(disk / "filler")
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
                await bus.js.publish("tasks.r.e", b"x" * 200_000, timeout=2)
            await until(lambda: "waits: disk full" in out.getvalue(), timeout_s=10, what="the stack saying disk full")
            [node] = stack.nats_nodes
            assert node.state == "waiting" and node.problem and "Critical write error" in node.problem
            assert started_pids(out, "nats-server") == [first]  # waiting: no restart on a full disk
            (disk / "filler").unlink()
            await until(lambda: len(started_pids(out, "nats-server")) == 2, timeout_s=10,
                        what="nats-server restarted once space was freed")
            assert "was stopped: a stream's store failed a write" in out.getvalue()

            async def takes_messages() -> bool:
                try:
                    await bus.js.publish("tasks.r.e", b"after", timeout=1)
                    return True
                except (nats.errors.Error, TimeoutError):
                    return False

            await until(takes_messages, timeout_s=20, what="the stream taking messages again")
            info = await bus.js.stream_info("TASKS")
            assert info.state.messages >= 4
            assert (await bus.js.get_msg("TASKS", 1)).data == b"kept 0"
        finally:
            await bus.close()
            stack.stopping.set()
            await running
