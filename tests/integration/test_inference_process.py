"""``python -m flywheel_inference`` as an operator starts it: it serves /healthz, beats its
heartbeat, and stops through the one shutdown path on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from flywheel.contract.bus import Bus
from flywheel.contract.service import read_heartbeats
from flywheel.ops.natsserver import NatsServer, free_port
from tests.helpers import until


async def test_the_process_serves_beats_and_stops_on_sigterm(nats_server: NatsServer, bus: Bus,
                                                             tmp_path: Path) -> None:
    port = free_port()
    env = os.environ | {"FLYWHEEL_NATS_URL": nats_server.url, "FLYWHEEL_DATA_DIR": str(tmp_path / "data"),
                        "FLYWHEEL_INFERENCE_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "flywheel_inference"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        async def healthy() -> bool:
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                return False

        await until(healthy, timeout_s=60, what="/healthz")

        async def beating() -> bool:
            return any(b.service == "inference" and b.info.get("url") == f"http://127.0.0.1:{port}"
                       for b in await read_heartbeats(bus))

        await until(beating, what="the heartbeat")
        info = await bus.js.consumer_info("TASKS", "inference")
        assert info.config.durable_name == "inference"
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal it caught once it has shut down.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        log = proc.stdout.read() if proc.stdout else ""
        assert "inference: stopped" in log, log
        assert not await beating()  # the heartbeat is removed on the way out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
