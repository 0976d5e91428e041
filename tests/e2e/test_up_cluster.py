"""``flywheel up --cluster 3``: three nats-server nodes on loopback, every stream on each; a node
killed mid-work is restarted by the stack, and nothing published is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flywheel.runtime.natsserver import free_port, port_open
from tests.e2e.conftest import stop_stack
from tests.e2e.test_up import READY_TIMEOUT_S, Output, flywheel, poll

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster_stack(tmp_path: Path, clean_env: dict[str, str]) -> Iterator[tuple[Output, dict[str, int]]]:
    nats_port = free_port()
    while any(port_open("127.0.0.1", nats_port + i) for i in (1, 2)):  # the nodes take nats_port and the two after it
        nats_port = free_port()
    ports = {"nats": nats_port, "gateway": free_port(), "inference": free_port()}
    up = subprocess.Popen([sys.executable, "-m", "flywheel.ops.cli", "up", "--cluster", "3",
                           "--data-dir", str(tmp_path / "data"), "--nats-port", str(ports["nats"]),
                           "--gateway-port", str(ports["gateway"]), "--inference-port", str(ports["inference"])],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env)
    output = Output(up)
    try:
        yield output, ports
    finally:
        stop_stack(up, output, tmp_path / "data")


def test_a_killed_node_is_restarted_and_nothing_published_is_lost(cluster_stack: tuple[Output, dict[str, int]],
                                                                   tmp_path: Path, clean_env: dict[str, str]) -> None:
    output, ports = cluster_stack
    output.wait_for(r"^Flywheel is up", READY_TIMEOUT_S)
    nodes = {m.group(1): int(m.group(2)) for m in output.matching(r"^started (nats-server-n\d) \(pid (\d+)\)")}
    assert set(nodes) == {"nats-server-n1", "nats-server-n2", "nats-server-n3"}
    nats = ["--nats-port", str(ports["nats"]), "--nats-cluster", "3"]
    gateway = f"http://127.0.0.1:{ports['gateway']}"

    def publish(name: str, texts: list[str]) -> None:
        rows = tmp_path / f"{name}.jsonl"
        rows.write_text("".join(json.dumps({"id": f"{name}-{t}", "text": t}) + "\n" for t in texts))
        done = flywheel("tasks", "publish", "reverse-text", "--run", "cluster", "--file", str(rows), *nats,
                        env=clean_env)
        assert done.returncode == 0, done.stderr

    def recorded(n: int) -> bool:
        response = httpx.get(f"{gateway}/v1/tasks", params={"run": "cluster", "limit": 100}, timeout=5)
        response.raise_for_status()
        return len(response.json()["items"]) == n

    publish("before", ["abc", "hello", "wheel"])
    poll(lambda: recorded(3), 30, "the recorder to store the 3 tasks published before the kill")

    os.kill(nodes["nats-server-n1"], signal.SIGKILL)  # the node every URL lists first
    output.wait_for(r"^nats-server-n1 \(pid \d+\) exited unexpectedly with signal SIGKILL", 10)
    publish("during", ["one", "two", "three", "four"])  # while it is down or rejoining
    output.wait_for(r"^started nats-server-n1 \(pid (\d+)\)", 30, count=2)
    poll(lambda: recorded(7), 60, "the recorder to store all 7 tasks after the node's death")

    status = flywheel("status", "--json", *nats, "--gateway-port", str(ports["gateway"]), env=clean_env)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    tasks = next(s for s in report["streams"] if s["stream"] == "TASKS")
    assert (tasks["messages"], tasks["replicas"]) == (7, 3)
    assert tasks["leader"] in {"n1", "n2", "n3"}
    node_1 = next(p for p in report["stacks"][0]["processes"] if p["name"] == "nats-server-n1")
    assert (node_1["state"], node_1["num_restarts"], node_1["last_exit"]) == ("running", 1, "signal SIGKILL")
