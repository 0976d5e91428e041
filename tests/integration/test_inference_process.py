"""``python -m flywheel_inference`` as an operator starts it: it serves /healthz, beats its
heartbeat, and stops through the one shutdown path on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import nats.js.errors

from flywheel.contract.bus import Bus
from flywheel.contract.service import read_heartbeats
from flywheel.runtime.natsserver import NatsServer, free_port
from tests.helpers import until


async def test_the_process_serves_beats_and_stops_on_sigterm(nats_server: NatsServer, bus: Bus,
                                                             tmp_path: Path) -> None:
    port = free_port()
    env = os.environ | {"FLYWHEEL_NATS_URL": nats_server.url, "FLYWHEEL_DATA_DIR": str(tmp_path / "data"),
                        "FLYWHEEL_INFERENCE_PORT": str(port)}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "flywheel_inference", env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)

    async def output() -> str:
        return (await proc.stdout.read()).decode() if proc.stdout else ""

    try:
        async def healthy() -> bool:
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
            except httpx.TransportError:
                assert proc.returncode is None, await output()
                return False

        await until(healthy, timeout_s=60, what="/healthz")

        async def beating() -> bool:
            return any(b.service == "inference" and b.info.get("url") == f"http://127.0.0.1:{port}"
                       for b in await read_heartbeats(bus))

        await until(beating, what="the heartbeat")

        async def consuming() -> bool:  # the heartbeat may come before the task consumer exists
            try:
                info = await bus.js.consumer_info("TASKS", "inference")
            except nats.js.errors.NotFoundError:
                return False
            return info.config.durable_name == "inference"

        await until(consuming, what="the task consumer")
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal it caught once it has shut down.
        assert await asyncio.wait_for(proc.wait(), 30) in (0, -signal.SIGTERM)
        log = await output()
        assert "inference: stopped" in log, log
        assert not await beating()  # the heartbeat is removed on the way out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
