"""``flywheel status`` against a real nats-server: heartbeats, the stack's view, stream depth,
consumer lag."""

from __future__ import annotations

import asyncio
import json
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest

from flywheel.contract import events
from flywheel.contract.bus import Bus, Consumer, Delivery
from flywheel.contract.service import Service, read_heartbeats
from flywheel.contract.settings import Settings
from flywheel.ops import cli
from flywheel.ops.commands import stack as stack_commands
from flywheel.ops.stack import STACK_SERVICE, Stack
from flywheel.runtime.natsserver import NatsServer, free_port
from flywheel.runtime.supervise import Process, ServiceSpec, Supervisor
from tests.helpers import until


async def status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the command in a thread (it runs its own event loop), as a user would."""
    code = await asyncio.to_thread(cli.main, ["status", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_status_shows_services_streams_and_consumer_lag(bus: Bus, nats_server: NatsServer,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    await bus.publish_many([events.Task(id=f"t{i}", run="r1", env="echo", data={"i": i}) for i in range(5)])
    release = asyncio.Event()

    async def slow(d: Delivery) -> None:
        await release.wait()

    # Holds two messages unacknowledged, so three are still pending on the server.
    consumer = Consumer(bus, stream="TASKS", durable="inference", handler=slow, max_in_flight=2)
    service_bus = await Bus.connect(nats_server.url, name="scorer")
    service = Service("scorer", service_bus, handle_signals=False)
    service.add(consumer)
    running = asyncio.ensure_future(service.run())
    await until(lambda: consumer._in_flight == 2, what="two tasks in flight")
    await until(lambda: _has_beat(bus, "scorer"), what="the scorer's heartbeat")
    no_gateway = f"http://127.0.0.1:{free_port()}"
    try:
        code, out, err = await status(capsys, "--json", "--nats-url", nats_server.url, "--gateway-url", no_gateway)
        assert code == 0, err
        report = json.loads(out)
        assert report["nats_url"] == nats_server.url
        assert report["gateway"]["url"] == no_gateway and report["gateway"]["ok"] is False
        assert "ConnectError" in report["gateway"]["error"]
        [scorer] = report["services"]
        assert (scorer["service"], scorer["pid"], scorer["status"], scorer["stale"]) == ("scorer", os.getpid(), "ok",
                                                                                         False)
        assert scorer["age_s"] < 10
        tasks_stream = next(s for s in report["streams"] if s["stream"] == "TASKS")
        assert tasks_stream["messages"] == 5 and tasks_stream["bytes"] > 0 and tasks_stream["consumers"] == 1
        assert [s["stream"] for s in report["streams"]] == [
            "TASKS", "ROLLOUTS", "TRACES", "SCORES", "SIGNALS", "WEIGHTS", "USAGE", "DEAD"]
        [lag] = report["consumers"]
        assert lag == {"stream": "TASKS", "consumer": "inference", "num_pending": 3, "num_ack_pending": 2,
                       "num_redelivered": 0, "num_waiting": lag["num_waiting"], "run": None, "pulled": True,
                       "last_active": lag["last_active"]}

        code, out, err = await status(capsys, "--nats-url", nats_server.url, "--gateway-url", no_gateway)
        assert code == 0, err
        assert f"NATS     {nats_server.url}  ok" in out
        assert f"gateway  {no_gateway}  unreachable (ConnectError" in out
        assert any(line.startswith("scorer ") and f" {os.getpid()}  ok " in line for line in out.splitlines())
        assert re.search(r"^TASKS +5 +[\d.]+ (B|KiB) +1 +1$", out, re.M), out
        assert re.search(r"^TASKS +inference +3 +2 +0  a process$", out, re.M), out
    finally:
        release.set()
        service.stop()
        await running


async def test_status_shows_the_stacks_view_naming_the_failing_process(
        bus: Bus, nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The view a stack publishes (Stack.view, in its heartbeat's info), read back through status."""

    async def healthy(stack: Supervisor, process: Process) -> None:
        return None

    stack = Stack(Settings(data_dir=tmp_path, nats_url=nats_server.url), services={
        "scorer": ServiceSpec(("-c", "pass"), healthy), "inference": ServiceSpec(("-c", "pass"), healthy)})
    scorer, inference = stack.services
    scorer.state, scorer.last_pid = "running", 1200
    inference.state, inference.last_pid, inference.num_restarts, inference.last_exit = "backing off", 1301, 6, "code 1"
    inference.backoff.num_failures, inference.backoff.delay_s = 7, 32.0
    inference.next_start_at = events.utc_now() + timedelta(seconds=30)
    service_bus = await Bus.connect(nats_server.url, name="stack")
    heartbeat = Service(STACK_SERVICE, service_bus, info=stack.view(), handle_signals=False)
    running = asyncio.ensure_future(heartbeat.run())
    await until(lambda: _has_beat(bus, STACK_SERVICE), what="the stack's heartbeat")
    try:
        code, out, err = await status(capsys, "--json", "--nats-url", nats_server.url)
        assert code == 0, err
        report = json.loads(out)
        assert report["services"] == []  # the stack is not one of the services
        [view] = report["stacks"]
        assert (view["pid"], view["stale"], view["failing"]) == (os.getpid(), False, ["inference"])
        assert (view["restart_backoff_s"], view["max_backoff_s"], view["healthy_after_s"]) == (1.0, 60.0, 30.0)
        by_name = {p["name"]: p for p in view["processes"]}
        assert list(by_name) == ["scorer", "inference"]
        assert by_name["scorer"] | {"log": None} == {
            "name": "scorer", "pid": 1200, "state": "running", "num_restarts": 0, "num_failures": 0, "backoff_s": 0.0,
            "last_exit": None, "last_exit_at": None, "healthy_since": None, "next_start_at": None,
            "next_start_in_s": None, "problem": None, "log": None}
        assert by_name["scorer"]["log"] == str(tmp_path.resolve() / "logs" / "scorer.log")
        failing = by_name["inference"]
        assert (failing["pid"], failing["num_restarts"], failing["num_failures"], failing["backoff_s"],
                failing["last_exit"]) == (1301, 6, 7, 32.0, "code 1")
        assert 20 < failing["next_start_in_s"] <= 30

        code, out, err = await status(capsys, "--nats-url", nats_server.url)
        assert code == 0, err
        row = r"^inference +1301 +backing off until \d\d:\d\d:\d\d \(in \d+s\) +6 +code 1 +\S+inference.log$"
        assert re.search(row, out, re.M), out
        failing_line = r"^inference is failing: last exit code 1, 7 exits in a row, 6 restarts; next try in \d+s"
        assert re.search(failing_line, out, re.M), out
    finally:
        heartbeat.stop()
        await running


async def _has_beat(bus: Bus, service: str) -> bool:
    return any(b.service == service for b in await read_heartbeats(bus))


async def test_status_changes_nothing_on_a_fresh_server(nats_server: NatsServer,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await status(capsys, "--nats-url", nats_server.url)
    assert code == 0, err
    assert "no services running" in out and "no Flywheel streams yet" in out and "no consumers" in out
    bus = await Bus.connect(nats_server.url, name="check", ensure=False)
    try:
        assert await bus.js.streams_info() == []  # status created no stream or bucket
    finally:
        await bus.close()


async def test_status_fails_clearly_when_nats_is_unreachable(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack_commands, "STATUS_CONNECT_TIMEOUT_S", 0.5)
    url = f"nats://127.0.0.1:{free_port()}"
    code, out, err = await status(capsys, "--nats-url", url)
    assert code == 1 and out == ""
    assert err.startswith(f"flywheel: error: cannot reach NATS at {url} within 0.5s")
    assert "Traceback" not in err


async def test_status_skips_a_stack_view_that_does_not_fit(bus: Bus) -> None:
    # The services bucket is open to any bus client: a "stack" entry with another shape is left out.
    from flywheel.ops.client import Client

    beat = events.ServiceHeartbeat(service="stack", instance="x", pid=1, host="h", started_at=events.utc_now(),
                                   info={"processes": "not a list"})
    await (await bus.services_kv()).put("stack.x", events.encode(beat))
    report = await Client(bus).status()
    assert report["stacks"] == [] and report["services"] == []
