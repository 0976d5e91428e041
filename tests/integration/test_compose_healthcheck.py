"""compose/healthcheck.py (the containers' healthcheck) against a real nats-server and HTTP server."""

from __future__ import annotations

import asyncio
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.contract.bus import Bus
from flywheel.contract.service import Service, read_heartbeats
from flywheel.runtime.natsserver import NatsServer, free_port
from tests.helpers import until

HEALTHCHECK = Path(__file__).resolve().parents[2] / "compose" / "healthcheck.py"


async def healthcheck(what: str, nats_url: str, **settings: str) -> subprocess.CompletedProcess[str]:
    """The script as a container runs it: its own process, settings from FLYWHEEL_*."""
    env = {"PATH": "/usr/bin:/bin", "FLYWHEEL_NATS_URL": nats_url,
           **{f"FLYWHEEL_{k.upper()}": v for k, v in settings.items()}}
    return await asyncio.to_thread(subprocess.run, [sys.executable, str(HEALTHCHECK), what], env=env,
                                   capture_output=True, text=True, timeout=60)


async def test_heartbeat_of_a_live_service_is_healthy(bus: Bus, nats_server: NatsServer) -> None:
    missing = await healthcheck("scorer", nats_server.url)
    assert missing.returncode == 1 and "no live heartbeat of 'scorer'" in missing.stderr

    service = Service("scorer", await Bus.connect(nats_server.url, name="scorer"), handle_signals=False)
    running = asyncio.ensure_future(service.run())
    try:
        async def beating() -> bool:
            return any(b.service == "scorer" for b in await read_heartbeats(bus))

        await until(beating, what="the scorer's heartbeat")
        # As docker does (its healthcheck has retries): a first look can miss a heartbeat that
        # was just written (it failed once in CI with the beat already read here).
        tries: list[subprocess.CompletedProcess[str]] = []

        async def healthy() -> bool:
            tries.append(await healthcheck("scorer", nats_server.url))
            return tries[-1].returncode == 0

        await until(healthy, timeout_s=30, what="the healthcheck to pass")
        other = await healthcheck("recorder", nats_server.url)
        assert other.returncode == 1
    finally:
        service.stop()
        await running


async def test_unreachable_nats_is_unhealthy() -> None:
    proc = await healthcheck("scorer", f"nats://127.0.0.1:{free_port()}")
    assert proc.returncode == 1 and proc.stderr.startswith("unhealthy:")


@pytest.fixture
def http_server() -> Iterator[tuple[int, list[int]]]:
    """A server whose /healthz answers the status code at the head of the list."""
    codes = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(codes[0] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], codes
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_gateway_healthz_on_its_port(http_server: tuple[int, list[int]]) -> None:
    port, codes = http_server
    nats_url = f"nats://127.0.0.1:{free_port()}"  # not asked for an HTTP check
    ok = await healthcheck("gateway", nats_url, gateway_port=str(port))
    assert ok.returncode == 0, ok.stderr
    codes[0] = 503
    down = await healthcheck("gateway", nats_url, gateway_port=str(port))
    assert down.returncode == 1 and "503" in down.stderr
    url = await healthcheck(f"http://127.0.0.1:{port}/elsewhere", nats_url)
    assert url.returncode == 1 and "404" in url.stderr
