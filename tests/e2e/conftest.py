"""Fixtures of the end-to-end tests: a clean environment and a ``flywheel up`` stack on free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.runtime.natsserver import free_port
from tests.e2e.test_up import Output
from tests.e2e.test_up_supervisor import alive

LOG_LINES_SHOWN = 60  # of each service's log, after a test of the stack


@pytest.fixture
def clean_env(tmp_path: Path) -> dict[str, str]:
    """This environment without the caller's Flywheel settings (the test passes its own), the
    data folder the ``stack`` fixture's: commands find the NATS operator's login there."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") or k == "FLYWHEEL_NATS_SERVER_BIN"} | {
        "FLYWHEEL_DATA_DIR": str(tmp_path / "data")}


@pytest.fixture
def stack(tmp_path: Path, clean_env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], Output, dict[str, int]]]:
    """``flywheel up`` on free ports; after the test, it and every process it printed are stopped,
    and the last lines of each service's log are printed (pytest shows them when the test failed)."""
    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    up = subprocess.Popen([sys.executable, "-m", "flywheel.ops.cli", "up", "--data-dir", str(tmp_path / "data"),
                           "--nats-port", str(ports["nats"]), "--gateway-port", str(ports["gateway"]),
                           "--inference-port", str(ports["inference"])],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env)
    output = Output(up)
    try:
        yield up, output, ports
    finally:
        stop_stack(up, output, tmp_path / "data")


@contextlib.contextmanager
def stack_up(data: Path, env: dict[str, str], timeout_s: float = 120) -> Iterator[dict[str, int]]:
    """``flywheel up`` with its data in ``data`` (a folder workers can read) and ``env``, on free
    ports (yielded: nats, gateway, inference), once it says it is up; stopped after."""
    ports = {"nats": free_port(), "gateway": free_port(), "inference": free_port()}
    up = subprocess.Popen([sys.executable, "-m", "flywheel.ops.cli", "up", "--data-dir", str(data), "--nats-port",
                           str(ports["nats"]), "--gateway-port", str(ports["gateway"]), "--inference-port",
                           str(ports["inference"])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env)
    output = Output(up)
    try:
        output.wait_for(r"^Flywheel is up", timeout_s)
        yield ports
    finally:
        stop_stack(up, output, data)


def stop_stack(up: subprocess.Popen[str], output: Output, data_dir: Path) -> None:
    """Stop ``flywheel up`` and every process it printed; print the last lines of each service's log."""
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    for match in output.matching(r"^started \S+ \(pid (\d+)\)"):
        pid = int(match.group(1))
        if alive(pid):  # only when the stack failed to stop it: it is ours either way
            os.kill(pid, signal.SIGKILL)
    for log in sorted((data_dir / "logs").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- last lines of {log.name} ---", *lines[-LOG_LINES_SHOWN:], sep="\n")
