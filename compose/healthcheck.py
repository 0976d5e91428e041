#!/usr/bin/env python3
"""``flywheel-healthcheck WHAT``: the healthcheck of a Flywheel container; exit 0 when healthy.

    flywheel-healthcheck gateway | inference      GET /healthz on this container's port (settings)
    flywheel-healthcheck SERVICE                  a live heartbeat of SERVICE from this host
    flywheel-healthcheck http://HOST:PORT/PATH    any URL answering 200

A heartbeat counts when its service name matches, its status is ``ok`` and its host is
this container's host name (containers on a compose network each have their own; with
host networking they share the machine's, so one healthy replica makes all of them pass).
Settings (NATS URL, ports) come from FLYWHEEL_* as in the service itself.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import urllib.error
import urllib.request

from flywheel.contract.settings import Settings

TIMEOUT_S = 5.0


def check_url(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


async def check_heartbeat(settings: Settings, service: str) -> str | None:
    from flywheel.contract.bus import Bus, BusConfig
    from flywheel.contract.service import read_heartbeats

    try:
        bus = await Bus.connect(settings.resolved_nats_url, f"healthcheck-{service}",
                                BusConfig(connect_timeout_s=TIMEOUT_S), ensure=False)
    except ConnectionError as exc:
        return str(exc)
    try:
        beats = await read_heartbeats(bus)
    finally:
        await bus.close()
    host = socket.gethostname()
    if any(b.service == service and b.status == "ok" and b.host == host for b in beats):
        return None
    return f"no live heartbeat of {service!r} from host {host!r}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    what = argv[0]
    settings = Settings()
    ports = {"gateway": settings.gateway_port, "inference": settings.inference_port}
    if what.startswith(("http://", "https://")):
        problem = check_url(what)
    elif what in ports:
        problem = check_url(f"http://127.0.0.1:{ports[what]}/healthz")
    else:
        problem = asyncio.run(check_heartbeat(settings, what))
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
