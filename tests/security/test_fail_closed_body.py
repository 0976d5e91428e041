"""Inference reads no body before it knows the caller, and none above its limit: a real
``python -m flywheel_inference`` process with keys on, sent 300 MiB bodies over a socket.

Found: inference parsed any body before it checked the key; 300 MiB without a key took its RSS
from 449 MB to 1.36 GB. Now a request without a good key is answered 401 before any of its body
is read, whether it declares its length or not, and a keyed one above ``inference.max_body_bytes``
gets 413: declared, before it is read; chunked, once the read passes the limit. Each time the
process's peak RSS (``VmHWM``, reset before each request) grows by less than ``RSS_BOUND_BYTES``,
and the answer comes while most of the body is still unsent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from flywheel.contract import keys
from flywheel.contract.bus import Bus
from flywheel.runtime.natsserver import NatsServer, free_port
from tests.helpers import until

BODY_BYTES = 300 * 1024 * 1024
MAX_BODY_BYTES = 1024 * 1024  # the process's inference.max_body_bytes
RSS_BOUND_BYTES = 64 * 1024 * 1024  # how much the peak RSS may grow while one such request is answered
CHUNK = 1024 * 1024


@dataclass
class Answer:
    status: int
    body: bytes
    num_sent: int  # body bytes the client had sent when the answer came
    elapsed_s: float


async def post(port: int, path: str, key: str | None, chunked: bool) -> Answer:
    """POST a ``BODY_BYTES`` JSON body (a prompt of that many letters), sent as fast as the server
    takes it while the answer is awaited; the answer and how much had been sent by then."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {key}\r\n" if key else ""
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {BODY_BYTES}\r\n\r\n"
    prefix = b'{"model": "no-such-run", "prompt": "'
    sent = 0
    started = time.monotonic()

    async def send() -> None:
        nonlocal sent
        writer.write(head.encode())
        while sent < BODY_BYTES:
            size = min(CHUNK, BODY_BYTES - sent)
            data = prefix + b"a" * (size - len(prefix)) if sent == 0 else (
                b"a" * (size - 2) + b'"}' if sent + size == BODY_BYTES else b"a" * size)
            writer.write(b"%x\r\n%s\r\n" % (size, data) if chunked else data)
            await writer.drain()
            sent += size
            # drain() returns without yielding while the kernel takes the data: without this, a
            # server that takes the body as fast as it comes keeps the answer unread here until
            # the whole body is sent, whenever it answered.
            await asyncio.sleep(0)  # noqa: sleep - a yield to the reader task, not a wait
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    sending = asyncio.ensure_future(send())
    try:
        status_line = await asyncio.wait_for(reader.readline(), 120)
        num_sent, elapsed_s = sent, time.monotonic() - started
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return Answer(int(status_line.split()[1]), body, num_sent, elapsed_s)


def status_of(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of the process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from the RSS now


@contextlib.asynccontextmanager
async def inference_process(nats_url: str, data_dir: Path) -> AsyncIterator[tuple[int, int]]:
    """``python -m flywheel_inference`` with keys on and a 1 MiB body limit: (pid, port), healthy."""
    port = free_port()
    env = os.environ | {"FLYWHEEL_NATS_URL": nats_url, "FLYWHEEL_DATA_DIR": str(data_dir), "FLYWHEEL_AUTH": "keys",
                        "FLYWHEEL_INFERENCE_PORT": str(port), "FLYWHEEL_LOG_LEVEL": "WARNING",
                        "FLYWHEEL_INFERENCE__MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "flywheel_inference", env=env,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async def healthy() -> bool:
            assert proc.returncode is None, (await proc.stderr.read()).decode() if proc.stderr else ""
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
            except httpx.TransportError:
                return False

        await until(healthy, timeout_s=60, what="inference's /healthz")
        yield proc.pid, port
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_bodies_are_not_read_without_a_key_nor_above_the_limit(nats_server: NatsServer, bus: Bus,
                                                                     tmp_path: Path) -> None:
    key, _ = await keys.create_key(bus, "a", ["read", "write"])
    async with inference_process(nats_server.url, tmp_path / "data") as (pid, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            small = {"model": "no-such-run", "prompt": "abc"}
            assert (await client.post("/v1/completions", json=small)).status_code == 401  # warms the path up
            keyed = await client.post("/v1/completions", json=small, headers={"Authorization": f"Bearer {key}"})
            assert keyed.status_code == 404, keyed.text  # under the limit: read, parsed and answered
        cases = [("/v1/completions", None, 401), ("/v1/chat/completions", "fw_0123456789abcdef_" + "x" * 43, 401),
                 ("/intercept/fw-not-a-rollout-key/v1/chat/completions", None, 401), ("/v1/completions", key, 413)]
        for path, sent_key, expected in cases:
            for chunked in (False, True):
                reset_peak(pid)
                before = status_of(pid)
                answer = await post(port, path, sent_key, chunked)
                after = status_of(pid)
                what = (path, "a key" if sent_key == key else "no good key", "chunked" if chunked else "declared")
                assert answer.status == expected, (what, answer.body)
                assert (b"limit of %d bytes" % MAX_BODY_BYTES in answer.body) == (expected == 413), answer.body
                growth = after["VmHWM"] - before["VmRSS"]
                print(f"{what}: {answer.status} after {answer.elapsed_s:.2f}s, {answer.num_sent >> 20} MiB of "
                      f"{BODY_BYTES >> 20} sent; peak RSS {before['VmRSS'] >> 20} -> {after['VmHWM'] >> 20} MiB")
                assert growth < RSS_BOUND_BYTES, (what, growth)
                # Answered before the client got far (what the kernel's buffers took meanwhile: tens
                # of MiB at most here; before the fix all 300 MiB were read, then parsed).
                assert answer.num_sent < BODY_BYTES // 2, (what, answer.num_sent)
