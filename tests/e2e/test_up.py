"""``flywheel up`` as a user runs it: the whole embedded stack, from start to Ctrl-C.

Starts ``flywheel up`` as a subprocess (its own nats-server, the gateway API, the
recorder, the scorer and inference) on free ports with a temporary data folder, publishes a JSONL file with
``flywheel tasks publish``, waits for the recorder to store the tasks (``GET /v1/tasks``),
reads ``flywheel status`` (the services' heartbeats and the supervisor's view of each
process), kills the recorder to see it restarted at once and counted, then sends SIGINT and
checks that every process the stack started is gone. The supervisor's failure paths are
in test_up_supervisor.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from flywheel.contract import natsusers
from flywheel.contract.bus import Bus, BusConfig, NatsRefused, PermissionDenied
from flywheel.contract.settings import Settings
from flywheel.runtime.natsserver import free_port
from tests.e2e.test_up_supervisor import alive

READY_TIMEOUT_S = 120.0  # the gateway imports FastAPI, SQLAlchemy and Alembic and migrates


class Output:
    """The lines a process prints, collected by a thread so waiting on them is bounded."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.ended = False
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` lines matching ``pattern`` (waiting for them to be printed)."""
        deadline = time.monotonic() + timeout_s
        while len(found := self.matching(pattern)) < count:
            if self.ended:
                raise AssertionError(f"the process ended before printing {pattern!r}; output:\n" + self.text)
            self._read_next(deadline, f"no line like {pattern!r} within {timeout_s}s")
        return found[:count]

    def exit_status(self, proc: subprocess.Popen[str], timeout_s: float) -> int:
        """The process's exit status, once it exited and printed its last line; an
        AssertionError with everything it printed if it did not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ended:
            self._read_next(deadline, f"the process did not exit within {timeout_s}s")
        return proc.wait(max(deadline - time.monotonic(), 5.0))

    def _read_next(self, deadline: float, failure: str) -> None:
        """One more line (or the end of the output), by ``deadline``; else AssertionError(failure)."""
        try:
            line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise AssertionError(f"{failure}; output:\n" + self.text) from None
        if line is None:
            self.ended = True
        else:
            self.lines.append(line)

    def matching(self, pattern: str) -> list[re.Match[str]]:
        return [m for line in self.lines if (m := re.search(pattern, line))]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


async def refused_as_scorer(nats_port: int, passwords: dict[str, str]) -> None:
    """On a stack's nats-server, the scorer's user cannot publish weights (nothing lands on the
    forged subject), and a connection without a login is refused, saying what to give."""
    url = f"nats://127.0.0.1:{nats_port}"
    scorer = await Bus.connect(natsusers.with_user(url, "scorer", passwords["scorer"]), "test-scorer",
                               BusConfig(request_timeout_s=1))  # finds the streams the stack made
    try:
        with pytest.raises(PermissionDenied, match=r"NATS refused user 'scorer' the publish to 'weights\.e2e'"):
            await scorer.publish_raw("weights.e2e", b"{}", {"Nats-Msg-Id": "forged"})
    finally:
        await scorer.close()
    operator = await Bus.connect(natsusers.with_user(url, natsusers.OPERATOR, passwords[natsusers.OPERATOR]),
                                 "test-operator", ensure=False)
    try:
        # Only the forged subject is looked at: a deployment's own trainer publishes weights.
        forged = await operator.js.stream_info("WEIGHTS", subjects_filter="weights.e2e")
        assert not forged.state.subjects, forged.state.subjects
    finally:
        await operator.close()
    with pytest.raises(NatsRefused, match=r"refused the login \(no user given\).*--data-dir"):
        await Bus.connect(url, "test-anonymous", BusConfig(connect_timeout_s=5), ensure=False)


def nats_login(data_dir: Path, nats_port: int) -> str:
    """The URL of a ``flywheel up`` stack's nats-server, logging in as its operator."""
    return Settings(data_dir=data_dir, nats_port=nats_port).resolved_nats_url


def poll(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)  # noqa: sleep - the polling interval of this bounded wait


def flywheel(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flywheel.ops.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


@pytest.mark.long
def test_up_publish_status_restart_and_stop(stack: tuple[subprocess.Popen[str], Output, dict[str, int]],
                                            tmp_path: Path, clean_env: dict[str, str]) -> None:
    up, output, ports = stack
    output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    pids = {m.group(1): int(m.group(2)) for m in output.matching(r"^started (\S+) \(pid (\d+)\)")}
    assert set(pids) == {"nats-server", "gateway", "orchestrator", "recorder", "scorer", "inference", "sandbox"}
    gateway = f"http://127.0.0.1:{ports['gateway']}"
    output.wait_for(rf"^  gateway   {gateway}$", 1)
    # A user a service; the operator's password is not shown.
    operator = rf"nats://operator:\*\*\*@127\.0\.0\.1:{ports['nats']}"
    output.wait_for(rf"^  NATS      {operator} \(pid {pids['nats-server']}\)$", 1)

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "abc"}\n{"text": "hello"}\n{"id": "t-3", "text": "flywheel"}\n')
    published = flywheel("tasks", "publish", "reverse-text", "--run", "e2e", "--file", str(rows), "--num-rollouts", "2",
                         "--nats-port", str(ports["nats"]), env=clean_env)
    assert published.returncode == 0, published.stderr
    assert published.stdout.startswith("published 3 tasks to tasks.e2e.reverse-text, 0 duplicates")

    recorded: list[dict] = []

    def tasks_recorded() -> bool:
        response = httpx.get(f"{gateway}/v1/tasks", params={"run": "e2e"}, timeout=5)
        response.raise_for_status()
        recorded[:] = response.json()["items"]
        return len(recorded) == 3

    poll(tasks_recorded, 30, "the recorder to store 3 tasks")
    assert sorted(t["data"]["text"] for t in recorded) == ["abc", "flywheel", "hello"]
    assert {t["num_rollouts"] for t in recorded} == {2} and "t-3" in {t["id"] for t in recorded}

    status = flywheel("status", "--json", "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
                      env=clean_env)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["gateway"]["ok"] is True
    assert {(s["service"], s["pid"]) for s in report["services"]} == {
        (name, pid) for name, pid in pids.items() if name != "nats-server"}
    assert next(s for s in report["streams"] if s["stream"] == "TASKS")["messages"] == 3
    recorder_tasks = next(c for c in report["consumers"] if c["consumer"] == "recorder-tasks")
    assert recorder_tasks["num_pending"] == 0 and recorder_tasks["num_ack_pending"] == 0
    [supervisor] = report["stacks"]
    assert supervisor["pid"] == up.pid and supervisor["failing"] == []
    assert {(p["name"], p["pid"], p["state"], p["num_restarts"], p["last_exit"]) for p in supervisor["processes"]} == {
        (name, pid, "running", 0, None) for name, pid in pids.items()}
    table = flywheel("status", "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
                     env=clean_env)
    assert table.returncode == 0, table.stderr
    assert re.search(rf"^recorder +\S+ +{pids['recorder']} +ok ", table.stdout, re.M), table.stdout
    assert re.search(r"^TASKS +recorder-tasks +0 +0 +0  a process$", table.stdout, re.M), table.stdout
    process_row = rf"^recorder +{pids['recorder']} +running +0 +- +\S+/recorder.log$"
    assert re.search(process_row, table.stdout, re.M), table.stdout

    # A second stack on the same data folder, on other ports, is refused before it opens the live
    # JetStream store or the fork server's sockets, naming the first; the first goes on untouched.
    other = [str(free_port()) for _ in range(3)]
    second = subprocess.run([sys.executable, "-m", "flywheel.ops.cli", "up", "--data-dir", str(tmp_path / "data"),
                             "--nats-port", other[0], "--gateway-port", other[1], "--inference-port", other[2]],
                            capture_output=True, text=True, env=clean_env, timeout=60, check=False)
    assert second.returncode != 0
    assert f"is in use by another stack (pid {up.pid} (flywheel up), NATS port {ports['nats']}" in second.stderr, (
        second.stdout + second.stderr)
    assert "started" not in second.stdout, second.stdout
    again = flywheel("status", "--json", "--nats-port", str(ports["nats"]), env=clean_env)
    assert next(s for s in json.loads(again.stdout)["streams"] if s["stream"] == "TASKS")["messages"] == 3
    assert [p["pid"] for p in json.loads(again.stdout)["stacks"][0]["processes"] if p["name"] == "nats-server"] == [
        pids["nats-server"]]

    # A user a service: what a service does not publish, its user cannot; no login, no bus; no
    # password in what status shows.
    passwords = natsusers.read(tmp_path / "data")
    assert passwords is not None and (tmp_path / "data" / natsusers.USERS_FILE).stat().st_mode & 0o077 == 0
    assert not any(password in status.stdout + table.stdout for password in passwords.values())
    asyncio.run(refused_as_scorer(ports["nats"], passwords))

    os.kill(pids["recorder"], signal.SIGKILL)
    output.wait_for(rf"^recorder \(pid {pids['recorder']}\) exited unexpectedly with signal SIGKILL after [\d.]+s "
                    r"healthy; restarting in 0s \(restart 1\)", 10)
    restarted = int(output.wait_for(r"^started recorder \(pid (\d+)\)", 5, count=2)[1].group(1))
    output.wait_for(r"^recorder is healthy", 60, count=2)
    views: list[dict] = []

    def recorder_running_again() -> bool:
        status = flywheel("status", "--json", "--nats-port", str(ports["nats"]), env=clean_env)
        assert status.returncode == 0, status.stderr
        views[:] = json.loads(status.stdout)["stacks"]
        return next(p for p in views[0]["processes"] if p["name"] == "recorder")["state"] == "running"

    poll(recorder_running_again, 10, "status to show the recorder running again")
    recorder = next(p for p in views[0]["processes"] if p["name"] == "recorder")
    assert (recorder["pid"], recorder["num_restarts"], recorder["last_exit"]) == (restarted, 1, "signal SIGKILL")
    assert views[0]["failing"] == []

    up.send_signal(signal.SIGINT)
    assert output.exit_status(up, 60) == 0, output.text
    output.wait_for(r"^stopped nats-server$", 5)
    for name, pid in [*pids.items(), ("restarted recorder", restarted)]:
        def gone(pid: int = pid) -> bool:
            return not alive(pid)

        poll(gone, 10, f"{name} (pid {pid}) to be gone")
