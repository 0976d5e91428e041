"""Latency and throughput of the sandbox service, per backend, through NATS.

    python benchmarks/sandbox.py --json out/sandbox.json [--backends local,docker] [--docker-engine]

One run, one fresh nats-server, the service as its own process (``python -m
flywheel_sandbox``, default settings: warm pool 4), the client in this process. Per backend:

- warm exec: one session, ``echo hi`` again and again (p50, p99);
- cold: create + exec + destroy of a new sandbox, one every ``--cold-interval-ms`` (the
  warm pool refills between them; p50, p99), and the same back to back (the pool runs dry,
  so most creates start a sandbox);
- throughput: 32 sessions at once, each running ``echo hi`` in a loop (execs/s);
- baseline: a bare ``subprocess.run`` of the same command here (p50), and on the local
  backend a bare ``bwrap ... echo hi`` (p50).

Keys per backend: ``warm_exec_p50_ms``, ``warm_exec_p99_ms``, ``cold_exec_p50_ms``,
``cold_exec_p99_ms``, ``cold_back_to_back_p50_ms``, ``throughput_32_sessions_execs_per_s``,
``baseline_p50_ms`` (and ``bare_bwrap_p50_ms`` for local). Targets on the local backend:
warm exec p50 at most 5 ms, cold p50 at most 25 ms.

The docker backend runs where ``DOCKER_HOST`` names an engine with ``FLYWHEEL_SANDBOX_IMAGE``
(an image with python3), or with ``--docker-engine``, which starts a private engine and a
Debian base image through tests/docker_engine.py (root only). Otherwise its entry says why
it was skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from flywheel.contract.bus import Bus
from flywheel.contract.service import read_heartbeats
from flywheel.runtime.natsserver import NatsServer
from flywheel.sdk.sandbox import SandboxClient, SandboxError, SandboxSpec

REPO = Path(__file__).resolve().parents[1]
CMD = "echo hi"
TARGETS = {"warm_exec_p50_ms": 5.0, "cold_exec_p50_ms": 25.0}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(fn: Callable[[], Awaitable[Any]], n: int, interval_s: float = 0.0) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await fn()
        elapsed = time.perf_counter() - started
        out.append(elapsed * 1000)
        if interval_s > elapsed:
            await asyncio.sleep(interval_s - elapsed)  # a deliberate sleep - the pacing of the cold measurement
    return out


async def start_service(url: str, env: dict[str, str], bus: Bus) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "flywheel_sandbox",
                                                env={**os.environ, **env, "FLYWHEEL_NATS_URL": url,
                                                     "FLYWHEEL_LOG_LEVEL": "WARNING"})
    for _ in range(600):
        if any(b.service == "sandbox" and b.pid == proc.pid for b in await read_heartbeats(bus)):
            return proc
        if proc.returncode is not None:
            raise RuntimeError(f"the sandbox service exited with {proc.returncode}")
        await asyncio.sleep(0.05)  # a deliberate sleep - the polling interval of this bounded wait
    raise RuntimeError("the sandbox service sent no heartbeat within 30 s")


async def measure(client: SandboxClient, args: argparse.Namespace) -> dict[str, float]:
    async def warm_exec() -> None:
        assert (await client.exec(box, CMD)).stdout == "hi\n"

    async def cold() -> None:
        b = await client.create()
        assert (await client.exec(b, CMD)).stdout == "hi\n"
        await client.destroy(b)

    box = await client.create()
    await timed(warm_exec, 20)
    warm = await timed(warm_exec, args.warm)
    await client.destroy(box)
    await asyncio.sleep(1.0)  # a deliberate sleep - let the warm pool fill before the paced cold round
    cold_paced = await timed(cold, args.cold, args.cold_interval_ms / 1000)
    cold_b2b = await timed(cold, args.cold)

    boxes = [await client.create(SandboxSpec()) for _ in range(32)]
    count = 0
    deadline = time.perf_counter() + args.throughput_s

    async def loop(b: str) -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            await client.exec(b, CMD)
            count += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop(b) for b in boxes))
    rate = count / (time.perf_counter() - started)
    for b in boxes:
        await client.destroy(b)
    return {"warm_exec_p50_ms": pct(warm, 0.5), "warm_exec_p99_ms": pct(warm, 0.99),
            "cold_exec_p50_ms": pct(cold_paced, 0.5), "cold_exec_p99_ms": pct(cold_paced, 0.99),
            "cold_back_to_back_p50_ms": pct(cold_b2b, 0.5), "cold_back_to_back_p99_ms": pct(cold_b2b, 0.99),
            "throughput_32_sessions_execs_per_s": rate}


def bare(argv: list[str], n: int = 100) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def docker_env(args: argparse.Namespace, stack: list[Any]) -> dict[str, str] | str:
    """Settings for a docker-backed service, or why there is none."""
    if args.docker_engine:
        sys.path.insert(0, str(REPO))
        from tests.docker_engine import DockerEngine, EngineUnavailable, debian_base_image

        try:
            engine = DockerEngine().start()
            stack.append(engine)
            image = debian_base_image(engine)
        except EngineUnavailable as exc:
            return str(exc)
        return {"DOCKER_HOST": engine.host, "FLYWHEEL_SANDBOX_BACKEND": "docker", "FLYWHEEL_SANDBOX_IMAGE": image}
    if not os.environ.get("DOCKER_HOST") or not os.environ.get("FLYWHEEL_SANDBOX_IMAGE"):
        return "set DOCKER_HOST and FLYWHEEL_SANDBOX_IMAGE, or pass --docker-engine (root)"
    return {"FLYWHEEL_SANDBOX_BACKEND": "docker"}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--backends", default="local", help="comma-separated: local, docker (default local)")
    parser.add_argument("--docker-engine", action="store_true", help="start a private Docker engine for the run")
    parser.add_argument("--warm", type=int, default=500, help="warm execs measured")
    parser.add_argument("--cold", type=int, default=100, help="cold create+exec+destroy measured (each way)")
    parser.add_argument("--cold-interval-ms", type=float, default=100.0, help="pacing of the cold round")
    parser.add_argument("--throughput-s", type=float, default=5.0, help="length of the 32-session round")
    args = parser.parse_args()
    result: dict[str, Any] = {"command": CMD, "targets": {"local": TARGETS}}
    engines: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        bus = await Bus.connect(server.url, name="benchmark")
        try:
            for backend in args.backends.split(","):
                env: dict[str, str] | str = {"FLYWHEEL_SANDBOX_BACKEND": "local"} if backend == "local" \
                    else docker_env(args, engines)
                if isinstance(env, str):
                    print(f"{backend}: skipped: {env}")
                    result[backend] = {"skipped": env}
                    continue
                env["FLYWHEEL_SANDBOX_MAX_ALIVE"] = "64"
                proc = await start_service(server.url, env, bus)
                figures: dict[str, Any]  # the figures, or the error that stopped them
                try:
                    figures = await measure(SandboxClient(bus), args)
                except SandboxError as exc:
                    figures = {"error": str(exc)}
                finally:
                    proc.terminate()
                    await proc.wait()
                figures["baseline_p50_ms"] = bare(["bash", "-c", CMD])
                if backend == "local":
                    figures["bare_bwrap_p50_ms"] = bare(["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr",
                                                         "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                                                         "--symlink", "usr/lib64", "/lib64", "--proc", "/proc",
                                                         "--", "/bin/bash", "-c", CMD])
                result[backend] = figures
                print(f"{backend}: " + "  ".join(f"{k} {v:.1f}" for k, v in figures.items()
                                                 if isinstance(v, float)))
        finally:
            await bus.close()
            server.stop()
            for engine in engines:
                engine.stop()
    local = result.get("local", {})
    if "warm_exec_p50_ms" in local:
        met = all(local[k] <= v for k, v in TARGETS.items())
        print(f"targets {'met' if met else 'NOT met'} on local: warm exec p50 <= 5 ms, cold p50 <= 25 ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
